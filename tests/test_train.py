"""The trainer end to end on a tiny random Llama with a real chat tokenizer (CPU, float32).

Checks: the loss drops and outputs are written; grad accumulation over quarter batches gives
the same update as one batch; 3 steps + resume + 3 steps equals 6 straight steps; SIGTERM
saves a checkpoint and stops cleanly; no host sync inside the micro-batch loop.
"""

import json
import math
import shutil
import signal

import pytest
import torch
import yaml
from helpers.runs import lora_with_dropout, losses, run_config, train_until_signal

from slipstream.config import config_from_dict
from slipstream.objectives.sft import SFT
from slipstream.train import train
from slipstream.train.loop import accumulate_gradients
from slipstream.train.setup import build_data, build_model
from slipstream.train.state import list_checkpoints


def test_full_finetune_loss_drops_and_writes_outputs(tiny_run, tmp_path):
    out = tmp_path / "run"
    summary = train(config_from_dict(run_config(tiny_run, out, steps=12)))
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5
    curve = losses(out)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1]
    for name in ["config.yaml", "metrics.jsonl", "summary.json", "loss.png", "config.json",
                 "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:  # fmt: skip
        assert (out / name).is_file(), name
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["train"]["steps"] == 12 and written["train"]["finetune"] == "full"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["eval_loss_after"] == summary["eval_loss_after"]
    assert 0.5 < on_disk["packing_efficiency"] <= 1.0


def test_grad_accum_matches_one_big_batch(tiny_run, tmp_path):
    """4 micro-batches of one example each == 1 batch of all 4: same grads, same update."""
    from slipstream.data import collate

    cfg = config_from_dict(run_config(tiny_run, tmp_path))
    data = build_data(cfg, _tokenizer(tiny_run))
    examples = data.train[:4]
    assert len({len(e.input_ids) for e in examples}) > 1  # unequal lengths: per-token weighting
    grads, params = [], []
    for window in ([collate(examples)], [collate([e]) for e in examples]):
        model = build_model(cfg, torch.device("cpu"))
        # SGD: the update is the gradient itself. (Adam's first step is ~lr*sign(g), which
        # turns float32 rounding in near-zero gradients into lr-sized differences.)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        accumulate_gradients(model, window, SFT())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=0)
    # Averaging each micro-batch on its own (the usual mistake) weighs short examples more.
    model = build_model(cfg, torch.device("cpu"))
    for e in examples:
        (model.loss(*_tensors(collate([e])), reduction="mean") / len(examples)).backward()
    per_batch_mean = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (per_batch_mean - grads[0]).abs().max() > 1e-4


def _tensors(batch):
    return batch.input_ids, batch.labels, batch.seq


def test_resume_gives_the_same_losses(tiny_run, tmp_path):
    """6 straight steps == 3 steps, stop, resume, 3 steps (data order, RNG, Adam, schedule)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    kw = dict(steps=6, grad_accum=4, lr=2e-2, save_every=3)
    train(config_from_dict(lora_with_dropout(run_config(tiny_run, straight, **kw))))
    # 20 batches an epoch, 4 a step: steps 4-6 cross into epoch 2, so the resumed data
    # stream must find both its place in an epoch and the next epoch's order.
    first = config_from_dict(lora_with_dropout(run_config(tiny_run, split, **kw)))
    train_until_signal(first, at_step=4)  # stops after step 4; resumes from the step-3 save
    resumed = lora_with_dropout(run_config(tiny_run, split, **kw))
    shutil.rmtree(split / "checkpoints" / "step-000004")  # as if killed before that save
    summary = train(config_from_dict({**resumed, "resume": True}))
    assert summary["status"] == "completed" and summary["steps"] == 6
    done = json.loads((straight / "summary.json").read_text())
    assert summary["tokens_trained"] == done["tokens_trained"]
    assert summary["eval_loss_before"] == done["eval_loss_before"]
    assert abs(summary["eval_loss_after"] - done["eval_loss_after"]) < 1e-6
    a, b = losses(straight), losses(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(a[step] - b[step]) < 1e-6, (step, a[step], b[step])


def test_sigterm_saves_checkpoint_and_stops(tiny_run, tmp_path):
    out = tmp_path / "run"
    cfg = config_from_dict(run_config(tiny_run, out, steps=6))
    summary = train_until_signal(cfg, at_step=2)
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    state = torch.load(list_checkpoints(out)[0] / "state.pt", weights_only=False)
    assert state["step"] == 2 and state["scheduler"]["last_epoch"] == 2
    assert not (out / "model.safetensors").exists()  # no final model from a stopped run
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def _tokenizer(tiny_run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_run[0])


def test_no_host_sync_in_the_micro_batch_loop(tiny_run, tmp_path):
    from slipstream.data import collate
    from slipstream.debug import count_syncs

    raw = lora_with_dropout(run_config(tiny_run, tmp_path))
    cfg = config_from_dict(raw)
    data = build_data(cfg, _tokenizer(tiny_run))
    model = build_model(cfg, torch.device("cpu"))
    window = [collate(data.train[i : i + 2]) for i in (0, 2, 4)]
    with count_syncs() as syncs:
        loss_sum, metrics = accumulate_gradients(model, window, SFT())
    assert syncs.total == 0, str(syncs)
    assert loss_sum.requires_grad is False and loss_sum.ndim == 0 and metrics == {}


def test_activation_checkpointing_keeps_the_losses(tiny_run, tmp_path):
    """`auto` (recompute on CPU) is wired in and changes nothing but memory."""
    curves = []
    for mode in ("none", "auto"):
        raw = lora_with_dropout(run_config(tiny_run, tmp_path / mode, steps=3, lr=2e-2))
        raw["train"]["activation_checkpointing"] = mode
        train(config_from_dict(raw))
        curves.append(losses(tmp_path / mode))
    assert curves[0].keys() == curves[1].keys() == {1, 2, 3}
    for step in curves[0]:
        assert abs(curves[0][step] - curves[1][step]) < 1e-5
    model = build_model(config_from_dict(raw), torch.device("cpu"))
    assert all(hasattr(layer, "_slipstream_plan") for layer in model.model.layers)


def test_schedule_and_optimizer_groups():
    from slipstream.train.optim import build_optimizer, build_schedule

    w = torch.nn.Parameter(torch.ones(4, 4))
    norm = torch.nn.Parameter(torch.ones(4))
    frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    named = [("w", w), ("norm", norm), ("frozen", frozen)]
    opt = build_optimizer(named, lr=1.0, weight_decay=0.1, device=torch.device("cpu"))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]  # frozen left out
    for name, last in [("linear", 1 - 7 / 8), ("cosine", 0.5 * (1 + math.cos(math.pi * 7 / 8)))]:
        opt = build_optimizer(named, lr=1.0, weight_decay=0.0, device=torch.device("cpu"))
        sched = build_schedule(opt, schedule=name, warmup_steps=2, total_steps=10)
        lrs = []
        for _ in range(10):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])  # warmup, then the peak
        assert lrs[-1] == pytest.approx(last)
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays monotonically
    with pytest.raises(ValueError, match="nothing to train"):
        build_optimizer([("frozen", frozen)], lr=1.0, weight_decay=0.0, device=torch.device("cpu"))


def test_cuda_rng_state_is_the_current_devices(monkeypatch):
    """Checkpoints hold the training device's CUDA RNG state (train() makes it current), and
    older checkpoints with one state per visible GPU still restore that device's entry."""
    from slipstream.train import state as st

    current = {"device": 1, "states": {0: "gpu0", 1: "gpu1"}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: current["states"][current["device"]])
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s))
    saved = st.rng_state()
    assert saved["cuda"] == "gpu1"
    st.set_rng_state(saved)
    st.set_rng_state({**saved, "cuda": ["old0", "old1"]})
    assert restored == ["gpu1", "old1"]


def test_mfu_is_logged_from_step_flops(tiny_run, tmp_path, monkeypatch):
    """On a device with a known peak the trainer logs MFU = step FLOPs (train/flops.py:
    4NT with LoRA plus attention) / time / peak. Checked on CPU with a pretend peak: the
    logged MFU sits just above the 4NT part alone (the tiny model's attention is small)."""
    from slipstream.train import meter
    from slipstream.train.flops import StepFlops

    peak = 1e9
    monkeypatch.setattr(meter, "peak_flops", lambda device: peak)
    raw = lora_with_dropout(run_config(tiny_run, tmp_path, steps=3))
    train(config_from_dict(raw))
    model = build_model(config_from_dict(raw), torch.device("cpu"))
    per_token = StepFlops(model, lora=True).per_token
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    for r in steps:
        ratio = r["mfu"] / (r["tokens_per_s"] * per_token / peak)
        assert 1.0 < ratio < 1.5, ratio


def test_lora_plus_gives_b_factors_their_multiple_of_the_lr(tiny_run, tmp_path):
    from safetensors.torch import load_file

    from slipstream.train.optim import build_optimizer, build_schedule

    a, b = torch.nn.Parameter(torch.ones(2, 4)), torch.nn.Parameter(torch.zeros(4, 2))
    norm = torch.nn.Parameter(torch.ones(4))
    named = [("q.lora_A.weight", a), ("q.lora_B.weight", b), ("norm.weight", norm)]
    cpu = torch.device("cpu")
    opt = build_optimizer(named, lr=0.5, weight_decay=0.1, device=cpu, lora_plus_ratio=16)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 8.0, 0.5]
    assert opt.param_groups[1]["params"] == [b] and opt.param_groups[1]["weight_decay"] == 0.1
    sched = build_schedule(opt, schedule="cosine", warmup_steps=2, total_steps=6)
    for _ in range(4):
        opt.step()
        sched.step()
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[1] == pytest.approx(16 * lrs[0]) and lrs[2] == lrs[0]  # the schedule keeps it
    with pytest.raises(ValueError, match="no LoRA B factors"):
        build_optimizer(named[2:], lr=0.5, weight_decay=0.0, device=cpu, lora_plus_ratio=16)

    # Through the trainer: the B factors grow faster than at one shared rate.
    sizes = {}
    for ratio in (None, 16.0):
        out = tmp_path / str(ratio)
        raw = run_config(tiny_run, out, steps=3, lr=1e-3)
        raw["train"]["finetune"] = "lora"
        raw["lora"] = {"rank": 4, "alpha": 8, "plus_ratio": ratio}
        train(config_from_dict(raw))
        tensors = load_file(out / "adapter_model.safetensors")
        sizes[ratio] = sum(t.norm() for k, t in tensors.items() if "lora_B" in k)
    assert sizes[16.0] > 5 * sizes[None] > 0  # measured 15.9x: Adam's early steps scale with lr


def test_objective_supplies_the_normaliser_and_metrics(tiny_run, tmp_path, monkeypatch):
    """An objective weighing per sequence (tests/helpers/objectives.py): the logged loss is the
    summed loss over sequences, metrics are their sums over the weight, eval goes through the
    same objective (`eval_`-prefixed, no eval_ppl), and SFT's eval loss per label times the
    labels equals its eval loss per sequence times the sequences."""
    from slipstream.objectives import OBJECTIVES, Entry

    monkeypatch.setitem(OBJECTIVES, "per_sequence", Entry("helpers.objectives:PerSequence"))
    records = {}
    for name in ("sft", "per_sequence"):
        raw = run_config(tiny_run, tmp_path / name, steps=2)
        raw["train"]["objective"] = name
        train(config_from_dict(raw))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records[name] = [json.loads(x) for x in lines]
    data = build_data(config_from_dict(raw), _tokenizer(tiny_run))
    labels = sum(sum(e.trainable[1:]) for e in data.eval)
    tokens = sum(len(e.input_ids) for e in data.eval)
    sft_eval, seq_eval = records["sft"][0], records["per_sequence"][0]
    assert "eval_ppl" in sft_eval and "eval_ppl" not in seq_eval
    assert seq_eval["eval_seqs"] == 1.0
    assert seq_eval["eval_seq_tokens"] == pytest.approx(tokens / len(data.eval))
    assert seq_eval["eval_loss"] * len(data.eval) == pytest.approx(sft_eval["eval_loss"] * labels)
    steps = [r for r in records["per_sequence"] if "loss" in r]
    assert [r["seqs"] for r in steps] == [1.0, 1.0]
    assert all(r["seq_tokens"] > 1 for r in steps)


def test_eval_keeps_no_autograd_graph(tiny_run, tmp_path, monkeypatch):
    """Evaluation runs under no_grad: with grad on, the running eval total held every eval
    batch's graph (activations included) until the end (a 135M DPO eval reached 19 GB)."""
    seen = []
    loss_of = SFT.micro_batch_loss

    def recording(self, model, batch):
        loss, metrics = loss_of(self, model, batch)
        seen.append((model.training, loss.requires_grad))
        return loss, metrics

    monkeypatch.setattr(SFT, "micro_batch_loss", recording)
    train(config_from_dict(run_config(tiny_run, tmp_path / "run", steps=1)))
    assert {grad for training, grad in seen if training} == {True}
    assert {grad for training, grad in seen if not training} == {False}  # before and after
