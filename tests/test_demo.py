"""The built-in demo end to end (slow: minutes on 2 CPU cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_demo_runs_offline_and_lowers_held_out_loss(tmp_path):
    start = time.perf_counter()
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "demo", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out loss:" in proc.stdout and "reply after:" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert (out / "adapter_model.safetensors").is_file()
    assert (out / "adapter_config.json").is_file()
    assert (out / "loss.png").is_file()
    print(f"demo took {elapsed:.0f} s")


def test_interrupted_demo_says_how_to_continue(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the demo's training was a TypeError (no eval_loss_after to print)."""
    import slipstream.checkpoint.gguf as gguf_module
    import slipstream.generation as generation
    import slipstream.train.loop as loop
    import slipstream.train.setup as setup
    from slipstream import cli

    stopped = {"status": "interrupted", "signal": "SIGINT", "steps": 5,
               "eval_loss_before": 4.02, "eval_loss_after": None}  # fmt: skip
    monkeypatch.setattr(gguf_module, "gguf_tokenizer", lambda path: None)
    monkeypatch.setattr(setup, "build_model", lambda cfg, device: None)
    monkeypatch.setattr(generation, "chat_reply", lambda *a, **k: "")
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: stopped)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--output-dir", str(out)]) == 130  # 128 + SIGINT, as train's
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"interrupted by SIGINT at step 5; its checkpoint is in {out / 'checkpoints'}" in err
    assert f"slipstream train {out / 'config.yaml'} resume=true" in err
