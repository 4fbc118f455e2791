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
