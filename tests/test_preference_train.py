"""Preference objectives through the trainer: a DPO run from an SFT adapter (TRL's metric
names, eval at step 0, the adapter loads in peft), grad-accum equivalence, precomputed
reference log-probs, and one-line errors for data of the wrong kind."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import make_tiny_run, run_config

from slipstream import cli
from slipstream.config import config_from_dict
from slipstream.train.loop import train

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")  # fmt: skip


def pair_rows(n: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What color is thing {i}?"}],
            "chosen": [{"role": "assistant", "content": f"It is {COLORS[i % 8]}."}],
            "rejected": [{"role": "assistant", "content": f"No idea, maybe {COLORS[i % 5]}."}],
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_train")
    model_dir, sft_data = make_tiny_run(root)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(24)))
    sft = root / "sft"  # a starting adapter, as an SFT run writes it
    raw = run_config((model_dir, sft_data), sft, steps=3)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    train(config_from_dict(raw))
    return model_dir, pairs, sft, sft_data


def dpo_config(tiny, out, **train_options):
    model_dir, pairs, sft, _ = tiny
    options = {"objective": "dpo", "steps": 4, "lr": 1e-2, **train_options}
    raw = run_config((model_dir, pairs), out, **options)
    raw["model"]["adapter"] = str(sft)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {}
    raw["data"]["eval_fraction"] = 0.25
    raw["train"]["tokens_per_batch"] = 256
    return raw


def write_yaml(path, raw):
    import yaml

    path.write_text(yaml.safe_dump(raw))
    return path


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_run_from_an_adapter(tiny, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    summary = train(config_from_dict(dpo_config(tiny, tmp_path / "dpo")))
    assert summary["status"] == "completed"
    assert summary["eval_ppl_before"] is None and summary["eval_ppl_after"] is None  # not a ppl
    rows = records(tmp_path / "dpo")
    evals = [r for r in rows if "eval_loss" in r]
    trains = [r for r in rows if "loss" in r]
    assert evals[0]["step"] == 0 and "eval_ppl" not in evals[0]
    # At step 0 the policy is the starting adapter, which is also the reference.
    assert evals[0]["eval_loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert evals[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for key in METRICS:
        assert key in trains[0] and f"eval_{key}" in evals[-1]
    assert evals[-1]["eval_rewards/margins"] > 0.0  # held-out pairs separate
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    # The adapter loads in peft on the transformers model, with our logits.
    hf = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "dpo").eval()
    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.ops.packing import SeqInfo

    ours = load_model(str(tiny[0]))
    load_adapter(ours, tmp_path / "dpo")
    ids = torch.tensor([1, 5, 9, 42, 7, 3])
    with torch.no_grad():
        want = peft_model(input_ids=ids[None]).logits[0]
        got = ours(ids, SeqInfo.from_lengths([6]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # The adapter moved off its start.
    start = json.loads((tiny[2] / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "dpo" / "adapter_config.json").read_text())["r"] == start["r"]


def test_grad_accum_equals_one_batch(tiny):
    """Pairs in two micro-batches give the gradient of one batch of them all."""
    from transformers import AutoTokenizer

    from slipstream.objectives import build_objective
    from slipstream.objectives.base import HookContext
    from slipstream.train.loop import accumulate_gradients
    from slipstream.train.setup import build_model

    cfg = config_from_dict(dpo_config(tiny, "unused"))
    objective = build_objective(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    pairs, _ = objective.tokenize(pair_rows(6), tokenizer)
    model = build_model(cfg, torch.device("cpu"))
    objective.attach(HookContext(model, tokenizer, torch.device("cpu"), 0, 0, 1), None)
    with torch.no_grad():  # move off the start so policy and reference differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(window):
        model.zero_grad()
        loss, metrics = accumulate_gradients(model, window, objective)
        return loss, metrics, [p.grad.clone() for p in params]

    one = grads([objective.collate(pairs)])
    two = grads([objective.collate(pairs[:2]), objective.collate(pairs[2:])])
    torch.testing.assert_close(one[0], two[0], atol=1e-5, rtol=1e-5)
    for key in METRICS:
        torch.testing.assert_close(one[1][key], two[1][key], atol=1e-5, rtol=1e-5)
    for a, b in zip(one[2], two[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_precomputed_reference_gives_the_same_run(tiny, tmp_path):
    raw = dpo_config(tiny, tmp_path / "a", steps=2)
    train(config_from_dict(raw))
    raw = dpo_config(tiny, tmp_path / "b", steps=2)
    raw["preference"] = {"precompute_reference": True}
    train(config_from_dict(raw))
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], abs=1e-5), key


def test_wrong_kind_of_data_is_one_line(tiny, tmp_path, capsys):
    model_dir, pairs, _, sft_data = tiny
    raw = run_config((model_dir, sft_data), tmp_path / "x", objective="dpo")
    assert cli.main(["train", str(write_yaml(tmp_path / "a.yaml", raw))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs preference data" in err[0] and "chosen" in err[0]
    raw = run_config((model_dir, pairs), tmp_path / "y")
    assert cli.main(["train", str(write_yaml(tmp_path / "b.yaml", raw))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "preference data" in err[0] and "train.objective" in err[0]
    raw = run_config((model_dir, pairs), tmp_path / "z", objective="dpo")
    raw["model"]["adapter"] = str(tmp_path / "nowhere")
    assert cli.main(["train", str(write_yaml(tmp_path / "c.yaml", raw))]) == 2
    assert "model.adapter" in capsys.readouterr().err


def test_eval_keeps_no_autograd_graph(tiny, tmp_path, monkeypatch):
    """A DPO eval holds no graph (the reference forward is no_grad anyway; the policy's was
    not, and the eval total kept all of them: 19 GB at step 0 on SmolLM2-135M)."""
    from slipstream.objectives.preference import PairObjective

    seen = []
    loss_of = PairObjective.micro_batch_loss

    def recording(self, model, batch):
        training = model.training  # the reference forward flips it inside
        loss, metrics = loss_of(self, model, batch)
        seen.append((training, loss.requires_grad))
        return loss, metrics

    monkeypatch.setattr(PairObjective, "micro_batch_loss", recording)
    train(config_from_dict(dpo_config(tiny, tmp_path / "dpo", steps=1)))
    assert {grad for training, grad in seen if training} == {True}
    assert {grad for training, grad in seen if not training} == {False}


@pytest.mark.parametrize(  # the default suite keeps one (~20 s each: torchrun)
    "reference, mode",
    [
        pytest.param("start", "ddp", marks=pytest.mark.slow),
        pytest.param("base", "ddp", marks=pytest.mark.slow),
        pytest.param("start", "fsdp", marks=pytest.mark.slow),
        ("base", "fsdp"),
    ],
)
def test_two_ranks_match_one_process(tiny, tmp_path, reference, mode):
    """DPO with LoRA from a (non-zero) adapter under DDP and FSDP2, 2 gloo ranks with
    grad_accum 1 against one process with grad_accum 2: the same losses, rewards, grad norms,
    eval and adapter. `start` writes the frozen starting adapter into the parameters (under
    FSDP2 into each rank's shards) for the reference forward; `base` swaps each adapter
    module for its base layer."""
    from helpers.torchrun import check, train_job
    from test_distributed import adapter

    model_dir, pairs, start, sft_data = tiny
    if reference == "start":
        start = tmp_path / "sft"
        raw = run_config((model_dir, sft_data), start, steps=3)
        raw["train"]["finetune"] = "lora"
        raw["lora"] = {"rank": 4, "alpha": 8,
                       "targets": ["q_proj", "v_proj", "down_proj"]}  # fmt: skip
        train(config_from_dict(raw))

    def config(out, **options):
        raw = dpo_config((model_dir, pairs, start, sft_data), out, **options)
        raw["preference"] = {"reference": reference}
        return raw

    train(config_from_dict(config(tmp_path / "single", grad_accum=2)))
    raw = config(tmp_path / mode, grad_accum=1, parallel=mode, dist_timeout_s=60)
    check(train_job(raw, tmp_path, timeout=240))
    want, got = records(tmp_path / "single"), records(tmp_path / mode)
    assert [sorted(r) for r in got] == [sorted(r) for r in want] and len(got) >= 5
    for rw, rg in zip(want, got, strict=True):
        for key in ("loss", "eval_loss", "rewards/margins", "eval_rewards/margins"):
            if key in rw:
                assert rg[key] == pytest.approx(rw[key], abs=1e-5), (rw["step"], key)
        if "grad_norm" in rw:
            assert rg["grad_norm"] == pytest.approx(rw["grad_norm"], rel=1e-4), rw["step"]
    # The reference differs from the policy once it moved: the margins are not all zero.
    assert max(abs(r.get("rewards/margins", 0.0)) for r in want) > 1e-3
    a, b = adapter(tmp_path / "single"), adapter(tmp_path / mode)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4)
