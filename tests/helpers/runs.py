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
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(48)))
    return model_dir, data


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
