"""Tiny end-to-end training runs shared by the trainer, CLI, MoE and distributed tests."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from helpers.models import make_hf_model
from helpers.tokenizers import save_test_tokenizer

COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
THINGS = ["sky", "grass", "sun", "snow", "coal", "car", "door", "cup", "hat", "ball"]


def chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        thing, color = THINGS[i % len(THINGS)], COLORS[(i * 3) % len(COLORS)]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What color is the {thing}?"},
                    {"role": "assistant", "content": f"The {thing} is {color}."},
                ]
            }
        )
    return rows


def make_tiny_run(root: Path) -> tuple[Path, Path]:
    """A tiny HF Llama folder with tokenizer files, and a jsonl chat dataset."""
    model_dir = root / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    make_hf_model(
        "llama",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        initializer_range=0.2,  # at 0.02 the logits are ~uniform and LoRA cannot move them
    ).save_pretrained(model_dir)
    return model_dir, _chat_data(root)


def make_tiny_type_run(root: Path, model_type: str, **overrides) -> tuple[Path, Path]:
    """make_tiny_run for any type transformers builds: the chat tokenizer, transformers'
    random model of `tiny_config(model_type, vocab_size=300, **overrides)` (seed 0; `layers`
    among the overrides), the 48 chat rows."""
    from helpers.tiny_hf import save_tiny

    model_dir = root / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    save_tiny(model_dir, model_type, **{"vocab_size": 300, **overrides})
    return model_dir, _chat_data(root)


def _chat_data(root: Path) -> Path:
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(48)))
    return data


def run_config(tiny_run, out, **train):
    model_dir, data = tiny_run
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data), "eval_fraction": 0.125},
        "train": {
            "finetune": "full", "lr": 3e-3, "steps": 6, "tokens_per_batch": 128, "warmup_steps": 1,
            "log_every": 1, "device": "cpu", "activation_checkpointing": "none", **train,
        },
        "output_dir": str(out),
    }  # fmt: skip


def lora_run_config(run, out, **train):
    """run_config of a LoRA r4 alpha 8 run: 4 steps at lr 2e-2 unless `train` says otherwise."""
    raw = run_config(run, out, **{"steps": 4, "lr": 2e-2, "dist_timeout_s": 60, **train})
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    return raw


def one_and_two_rank_runs(run, tmp: Path, **train) -> None:
    """`lora_run_config` runs into tmp/single (one process, grad_accum 4) and tmp/ddp,
    tmp/fsdp (2 gloo ranks each, grad_accum 2): the same global batches."""
    from helpers.torchrun import check, train_job
    from slipstream.config import config_from_dict
    from slipstream.train import train as train_run

    train_run(config_from_dict(lora_run_config(run, tmp / "single", grad_accum=4, **train)))
    for mode in ("ddp", "fsdp"):
        raw = lora_run_config(run, tmp / mode, grad_accum=2, parallel=mode, **train)
        check(train_job(raw, tmp))


def losses(out) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def lora_with_dropout(raw):
    # Dropout draws from the torch RNG every step: resume must restore the RNG exactly.
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8, "dropout": 0.2}
    return raw


def train_until_signal(cfg, at_step, signum=signal.SIGTERM, run=None):
    """Run `train(cfg)` (or `run()`, e.g. the CLI) and send `signum` to ourselves during
    optimizer step `at_step`."""
    from slipstream.checkpoint import hf
    from slipstream.train import train

    calls = {"n": 0}
    per_step = cfg.train.grad_accum
    real_load = hf.load_model

    def load_and_hook(*args, **kwargs):
        model = real_load(*args, **kwargs)
        real_loss = model.loss

        def loss(*a, **k):
            if model.training:
                calls["n"] += 1
                if calls["n"] == at_step * per_step:
                    os.kill(os.getpid(), signum)
            return real_loss(*a, **k)

        model.loss = loss
        return model

    hf.load_model = load_and_hook
    try:
        return run() if run is not None else train(cfg)
    finally:
        hf.load_model = real_load


def assert_adapter_loads_in_peft(base: Path, adapter: Path, ids: list[int] | None = None) -> None:
    """A run's saved adapter loads in peft on transformers' model of `base` with the logits
    of our model with that adapter (and they differ from the base's: it is not a no-op)."""
    import warnings

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.ops.packing import SeqInfo

    ids_T = torch.tensor(ids or [1, 17, 42, 5, 99, 230, 7, 64, 3, 150])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            plain = hf(input_ids=ids_T[None]).logits[0]
        theirs = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ours = load_adapter(load_model(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        want = theirs(input_ids=ids_T[None]).logits[0]
        got = ours(ids_T, SeqInfo.from_lengths([len(ids_T)]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - plain).abs().max() > 1e-4, "the adapter changes nothing"
