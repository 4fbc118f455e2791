"""KTO and reward modelling through the trainer on a tiny random Llama: runs that log TRL's
metric names and save what peft / transformers load; packed batches equal their sequences
run alone; grad-accum equals one batch; no host sync in a step; a run stopped by a signal
and resumed repeats the uninterrupted one; bad rows and config are one line (exit 2).
Slow: 2 gloo ranks (DDP) equal one process with grad_accum 2."""

from __future__ import annotations

import json
import os
import signal
import warnings

import pytest
import torch
from helpers.runs import assert_adapter_loads_in_peft, make_tiny_run, run_config
from test_preference_train import pair_rows

from slipstream import cli
from slipstream.config import config_from_dict
from slipstream.train.loop import train

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
KTO_KEYS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "count/desirable")  # fmt: skip
REWARD_KEYS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


def unpaired_rows(n: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What color is thing {i}?"}],
            "completion": [{"role": "assistant", "content": f"It is {COLORS[i % 8]}."
                            if i % 3 else f"No idea, maybe {COLORS[i % 5]}."}],
            "label": bool(i % 3),
        }
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto_reward_train")
    model_dir, sft_data = make_tiny_run(root)
    pairs, unpaired = root / "pairs.jsonl", root / "unpaired.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(24)))
    unpaired.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(36)))
    sft = root / "sft"  # a starting adapter, as an SFT run writes it
    raw = run_config((model_dir, sft_data), sft, steps=3)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    train(config_from_dict(raw))
    return {"model": model_dir, "pairs": pairs, "unpaired": unpaired, "sft": sft,
            "sft_data": sft_data}  # fmt: skip


def config(tiny, objective, out, data="pairs", **train_options):
    options = {"objective": objective, "steps": 4, "lr": 1e-2, **train_options}
    raw = run_config((tiny["model"], tiny[data]), out, **options)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    if objective == "kto":
        raw["model"]["adapter"] = str(tiny["sft"])
        raw["lora"] = {}
    raw["data"]["eval_fraction"] = 0.25
    raw["train"]["tokens_per_batch"] = 256
    return raw


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_reward_run_saves_a_model_transformers_and_peft_load(tiny, tmp_path):
    import peft
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from slipstream.checkpoint.reward_model import load_reward_model

    out = tmp_path / "rm"
    summary = train(config_from_dict(config(tiny, "reward", out, steps=6)))
    assert summary["status"] == "completed" and summary["eval_ppl_after"] is None
    rows = records(out)
    evals = [r for r in rows if "eval_loss" in r]
    trains = [r for r in rows if "loss" in r]
    for key in REWARD_KEYS:
        assert key in trains[0] and f"eval_{key}" in evals[0] and f"eval_{key}" in evals[-1]
    for r in trains + [{k.removeprefix("eval_"): v for k, v in e.items()} for e in evals]:
        assert r["min_reward"] < r["mean_reward"] < r["max_reward"], r  # extremes, not means
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns the held-out pairs
    config_json = json.loads((out / "adapter_config.json").read_text())
    assert config_json["modules_to_save"] == ["score"] and config_json["task_type"] == "SEQ_CLS"
    # peft on transformers' classifier scores as we do.
    tokenizer = AutoTokenizer.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(
            tiny["model"], num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32
        )
    hf = peft.PeftModel.from_pretrained(hf, out).eval()
    ours = load_reward_model(out)
    ids = [[1, 5, 9, 42, 7, 3], [8, 2, 11]]
    from slipstream.scoring import RewardScorer

    scorer = RewardScorer(out)
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in ids]
    assert scorer.score_ids(ids) == pytest.approx(want, abs=1e-5)
    assert ours.score.weight.requires_grad


def test_a_logged_interval_logs_the_extremes_of_its_steps(tiny, tmp_path):
    """log_every 2 against 1, the same run: `min_reward`/`max_reward` are the min/max of the
    interval's steps (the meter's fold), and the steps' extremes differ."""
    for every in (1, 2):
        raw = config(tiny, "reward", tmp_path / str(every), steps=4, log_every=every)
        raw["data"]["eval_fraction"] = 0
        train(config_from_dict(raw))
    one, two = ([r for r in records(tmp_path / str(e)) if "loss" in r] for e in (1, 2))
    assert [r["step"] for r in two] == [2, 4] and len(one) == 4
    for r, (a, b) in zip(two, zip(one[::2], one[1::2], strict=True), strict=True):
        assert r["min_reward"] == pytest.approx(min(a["min_reward"], b["min_reward"]), abs=1e-6)
        assert r["max_reward"] == pytest.approx(max(a["max_reward"], b["max_reward"]), abs=1e-6)
        assert a["min_reward"] != b["min_reward"] and a["max_reward"] != b["max_reward"]


def test_full_reward_run_saves_a_sequence_classifier(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm_full"
    raw = config(tiny, "reward", out, steps=2, lr=1e-3)
    raw["train"]["finetune"] = "full"
    assert train(config_from_dict(raw))["status"] == "completed"
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForSequenceClassification"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    from slipstream.scoring import RewardScorer

    ids = [[1, 5, 9, 42, 7, 3]]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits[0, 0].item()
    assert RewardScorer(out).score_ids(ids) == pytest.approx([want], abs=1e-5)


def test_kto_run_from_an_adapter(tiny, tmp_path):
    out = tmp_path / "kto"
    summary = train(config_from_dict(config(tiny, "kto", out, data="unpaired")))
    assert summary["status"] == "completed"
    rows = records(out)
    evals = [r for r in rows if "eval_loss" in r]
    trains = [r for r in rows if "loss" in r]
    for key in KTO_KEYS:  # a class's means only where it has examples (TRL's rule); packed
        # by length, this data's micro-batches hold one class each, so no step has a margin
        assert f"eval_{key}" in evals[-1], key
        assert any(key in r for r in trains) or key == "rewards/margins", key
    # At step 0 the policy is the reference: the log-ratios are 0, the loss 1 - sigmoid(0).
    assert evals[0]["eval_loss"] == pytest.approx(0.5, abs=1e-6)
    assert evals[0]["eval_kl"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < evals[0]["eval_count/desirable"] < 1
    assert evals[-1]["eval_rewards/margins"] > 0  # desirable completions rise over the others
    assert_adapter_loads_in_peft(tiny["model"], out)  # peft's logits = ours


def _objective(tiny, name, **section):
    from transformers import AutoTokenizer

    from slipstream.objectives import build_objective
    from slipstream.objectives.base import HookContext
    from slipstream.train.setup import build_model

    data = "unpaired" if name == "kto" else "pairs"
    raw = config(tiny, name, "unused", data=data)
    raw[name] = section
    cfg = config_from_dict(raw)
    objective = build_objective(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny["model"])
    rows = unpaired_rows(8) if name == "kto" else pair_rows(6)
    examples, _ = objective.tokenize(rows, tokenizer)
    model = build_model(cfg, torch.device("cpu"))
    objective.attach(HookContext(model, tokenizer, torch.device("cpu"), 0, 0, 1), None)
    with torch.no_grad():  # move off the start so policy and reference differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    return objective, model, examples


def _grads(model, objective, window):
    from slipstream.train.loop import accumulate_gradients

    model.zero_grad()
    loss, metrics = accumulate_gradients(model, window, objective)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, metrics, [p.grad.clone() for p in params]


@pytest.mark.parametrize(
    ("name", "section"),
    [("reward", {"center_rewards_coefficient": 0.1}), ("kto", {"loss_type": "apo_zero_unpaired"})],
)
def test_grad_accum_equals_one_batch(tiny, name, section):
    """Micro-batches of a window give the gradient of one batch of them all (KTO without the
    KL term: with it, each micro-batch has its own estimate, as in TRL)."""
    objective, model, examples = _objective(tiny, name, **section)
    one = _grads(model, objective, [objective.collate(examples)])
    two = _grads(model, objective, [objective.collate(examples[:2]),
                                    objective.collate(examples[2:])])  # fmt: skip
    torch.testing.assert_close(one[0], two[0], atol=1e-5, rtol=1e-5)
    for key in one[1]:
        torch.testing.assert_close(one[1][key], two[1][key], atol=1e-5, rtol=1e-5)
    for a, b in zip(one[2], two[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["reward", "kto"])
def test_packed_equals_each_sequence_alone(tiny, name):
    """A packed micro-batch's per-sequence numbers equal each sequence run on its own."""
    from slipstream.models.score_head import sequence_scores
    from slipstream.ops.packing import SeqInfo

    objective, model, examples = _objective(tiny, name)
    batch = objective.collate(examples)
    with torch.no_grad():
        if name == "reward":
            packed = sequence_scores(model, batch.input_ids, batch.seq, batch.score_positions)
            alone = []
            for ex in examples:
                for ids, at in ((ex.chosen, ex.chosen_at), (ex.rejected, ex.rejected_at)):
                    t = torch.tensor(ids)
                    alone.append(sequence_scores(model, t, SeqInfo.from_lengths([len(ids)]),
                                                 torch.tensor([at]))[0])  # fmt: skip
        else:
            n = len(examples)
            packed = torch.cat([objective.sequence_logps(model, batch.main, n),
                                objective.sequence_logps(model, batch.kl, n)])  # fmt: skip
            alone = []
            for stream in ("main", "kl"):
                for i in range(n):
                    one = objective.collate([examples[i]]) if stream == "main" else None
                    if stream == "kl":  # example i's KL sequence, packed alone
                        from slipstream.objectives.kto_data import KTOExample, kl_sequences

                        kl = kl_sequences(examples, 1 << 30)[i]
                        one = objective.collate([KTOExample(kl.ids, kl.prompt_len, True)])
                    alone.append(objective.sequence_logps(model, one.main, 1)[0])
    torch.testing.assert_close(packed, torch.stack(alone), atol=1e-5, rtol=1e-5)
    assert len(batch.seq.lengths) > 1


@pytest.mark.parametrize("name", ["reward", "kto"])
def test_a_step_has_no_host_sync(tiny, name):
    from slipstream.debug import count_syncs

    objective, model, examples = _objective(tiny, name)
    batch = objective.collate(examples)
    with count_syncs() as syncs:
        loss, _ = objective.micro_batch_loss(model, batch)
        (loss / len(examples)).backward()
    assert syncs.total == 0, syncs


def _train_until_signal(cfg, at_call):
    """`train(cfg)`, sending SIGTERM to ourselves in the `at_call`-th training micro-batch."""
    from slipstream.objectives.kto import KTO
    from slipstream.objectives.reward import Reward

    cls = KTO if cfg.train.objective == "kto" else Reward
    real, calls = cls.micro_batch_loss, {"n": 0}

    def counting(self, model, batch):
        if model.training:
            calls["n"] += 1
            if calls["n"] == at_call:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(self, model, batch)

    cls.micro_batch_loss = counting
    try:
        return train(cfg)
    finally:
        cls.micro_batch_loss = real


@pytest.mark.parametrize("name", ["reward", "kto"])
def test_resume_after_a_signal_repeats_the_uninterrupted_run(tiny, tmp_path, name):
    data = "unpaired" if name == "kto" else "pairs"

    def raw(out):
        r = config(tiny, name, out, data=data, steps=4, grad_accum=2, save_every=2)
        r["lora"]["dropout"] = 0.1  # resume must restore the RNG too
        return r

    train(config_from_dict(raw(tmp_path / "straight")))
    summary = _train_until_signal(config_from_dict(raw(tmp_path / "resumed")), at_call=5)
    assert summary["status"] == "interrupted" and summary["steps"] == 3
    assert train(config_from_dict({**raw(tmp_path / "resumed"), "resume": True}))["status"] == (
        "completed"
    )
    want = {r["step"]: r for r in records(tmp_path / "straight") if "loss" in r}
    got = {r["step"]: r for r in records(tmp_path / "resumed") if "loss" in r}
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6), step
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=1e-5)


def _yaml(path, raw):
    import yaml

    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_bad_rows_and_config_are_one_line(tiny, tmp_path, capsys):
    def fails(raw, *words):
        assert cli.main(["train", _yaml(tmp_path / "c.yaml", raw)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err

    fails(config(tiny, "kto", tmp_path / "a", data="sft_data"), "kto needs unpaired", "label")
    fails(config(tiny, "reward", tmp_path / "b", data="sft_data"), "needs preference data")
    bad = tmp_path / "bad.jsonl"
    rows = unpaired_rows(8)
    rows[3]["label"] = "yes"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = config(tiny, "kto", tmp_path / "c", data="unpaired")
    raw["data"] = {"train": str(bad), "strict": True}
    fails(raw, "data row 3", "label")
    raw = config(tiny, "kto", tmp_path / "d", data="unpaired")
    raw["kto"] = {"beta": -1}
    fails(raw, "kto.beta")
    raw = config(tiny, "reward", tmp_path / "e")
    raw["reward"] = {"center_rewards_coefficient": "lots"}
    fails(raw, "reward.center_rewards_coefficient")
    raw = config(tiny, "reward", tmp_path / "f", parallel="fsdp")
    fails(raw, "parallel=ddp")


def test_fsdp_from_parallel_auto_is_refused_in_one_line(tiny, tmp_path, monkeypatch):
    """train.parallel=auto with full fine-tuning resolves to FSDP2 under torchrun: reward and
    distill refuse it when attached (before any sharding), naming train.parallel=ddp; an
    explicit fsdp is refused by the config itself."""
    from slipstream import distributed as dist
    from slipstream.objectives import build_objective
    from slipstream.objectives.base import HookContext

    raw = config(tiny, "reward", tmp_path)
    raw["train"]["finetune"] = "full"
    teacher = {"teacher": str(tiny["model"]), "lmbda": 0.0}
    distill = {**raw, "train": {**raw["train"], "objective": "distill"}, "distill": teacher}
    for case in (raw, distill):
        cfg = config_from_dict(case)
        assert cfg.train.parallel == "auto"
        objective = build_objective(cfg)
        monkeypatch.setattr(dist, "world_size", lambda: 2)
        ctx = HookContext(None, None, torch.device("cpu"), seed=0, rank=0, world_size=2)
        with pytest.raises(ValueError, match="train.parallel=ddp") as e:
            objective.attach(ctx, None)
        assert "\n" not in str(e.value) and "fsdp" in str(e.value)
        monkeypatch.undo()
        with pytest.raises(ValueError, match="not fsdp"):
            config_from_dict({**case, "train": {**case["train"], "parallel": "fsdp"}})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reward", "kto"])
def test_two_ranks_match_one_process(tiny, tmp_path, name):
    """LoRA under DDP, 2 gloo ranks with grad_accum 1 against one process with grad_accum 2:
    the same losses, metrics, grad norms, eval and result."""
    from helpers.torchrun import check, train_job
    from safetensors.torch import load_file

    data = "unpaired" if name == "kto" else "pairs"
    train(config_from_dict(config(tiny, name, tmp_path / "single", data=data, grad_accum=2)))
    raw = config(tiny, name, tmp_path / "ddp", data=data, grad_accum=1, parallel="ddp",
                 dist_timeout_s=60)  # fmt: skip
    check(train_job(raw, tmp_path, timeout=300))
    want, got = records(tmp_path / "single"), records(tmp_path / "ddp")
    assert [sorted(r) for r in got] == [sorted(r) for r in want] and len(got) >= 5
    keys = ("loss", "eval_loss", *KTO_KEYS, *REWARD_KEYS)
    for rw, rg in zip(want, got, strict=True):
        for key in (k for k in rw if k in keys or k.removeprefix("eval_") in keys):
            assert rg[key] == pytest.approx(rw[key], abs=1e-5), (rw["step"], key)
        if "grad_norm" in rw:
            assert rg["grad_norm"] == pytest.approx(rw["grad_norm"], rel=1e-4), rw["step"]
    a = load_file(tmp_path / "single" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ddp" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4)


def test_a_generic_reward_run_repeats_the_native_run(tiny, tmp_path, capsys):
    """The same LoRA reward run on transformers' modeling code (`model.implementation:
    transformers`, the generic family) logs the native run's losses and reward metrics and
    saves an adapter that peft loads on transformers' classifier with our scores."""
    import peft
    from transformers import AutoModelForSequenceClassification

    from slipstream.scoring import RewardScorer

    runs = {}
    for implementation in ("native", "transformers"):
        out = tmp_path / implementation
        raw = config(tiny, "reward", out, steps=3)
        raw["model"]["implementation"] = implementation
        assert train(config_from_dict(raw))["status"] == "completed"
        runs[implementation] = [r for r in records(out) if "loss" in r]
    said = capsys.readouterr().err  # the load line: which path and why
    assert "model llama: native family" in said
    assert "model llama: transformers' modeling code, as model.implementation=transformers" in said
    assert len(runs["native"]) == 3
    for a, b in zip(runs["native"], runs["transformers"], strict=True):
        for key in ("loss", *REWARD_KEYS):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    out = tmp_path / "transformers"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForSequenceClassification.from_pretrained(
            tiny["model"], num_labels=1, pad_token_id=RewardScorer(out).pad_id,
            dtype=torch.float32,
        )  # fmt: skip
    hf = peft.PeftModel.from_pretrained(hf, out).eval()
    ids = [[1, 5, 9, 42, 7, 3], [8, 2, 11]]
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in ids]
    assert RewardScorer(out).score_ids(ids) == pytest.approx(want, abs=1e-5)
