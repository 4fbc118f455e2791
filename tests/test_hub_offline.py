"""A hub id without a network: said at once (no minute of retries), with the offline choice;
a repo already in the hub cache loads from it. No real network is used: offline is
HF_HUB_OFFLINE=1 or an HF_ENDPOINT at a closed local port, in a fresh process (huggingface_hub
reads both when imported), with an empty hub cache under tmp_path."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.runs import run_config

ROOT = Path(__file__).resolve().parent.parent
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the shipped configs' model
FAST_S = 20.0  # generous on a loaded 2-core machine; offline took 49-58 s before


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed: connect is refused


def offline_env(tmp_path: Path, how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env = {k: v for k, v in env.items() if "proxy" not in k.lower()}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"))
    if how == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
    return env


def run_python(code: str, env: dict, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
        timeout=300,
    )  # fmt: skip
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("how", ["offline", "closed_port"])
def test_cli_says_no_network_at_once(tiny_run, tmp_path, how):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run_config(tiny_run, tmp_path / "out")))
    code = (
        "import sys\nfrom slipstream import cli\n"
        f"rc = cli.main(['train', {str(config)!r}, 'model.path={HUB_ID}'])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')\nsys.exit(rc)\n"
    )
    proc, seconds = run_python(code, offline_env(tmp_path, how), tmp_path)
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert err.startswith(f"slipstream: error: model.path: '{HUB_ID}' is a hub id"), err
    assert "no network" in err and "model.path=smollm2-demo" in err, err
    assert ("HF_HUB_OFFLINE" in err) == (how == "offline"), err
    assert "NO_TORCH" in proc.stdout and seconds < FAST_S, seconds


def test_api_says_no_network_at_once(tmp_path):
    code = (
        "import time\nimport slipstream\n"
        "import slipstream.checkpoint.hf  # torch and the models: imported, not timed\n"
        "from slipstream.checkpoint.tokenizer import load_tokenizer\n"
        "start = time.perf_counter()\n"
        f"for call in (load_tokenizer, slipstream.load_model):\n"
        f"    try:\n        call({HUB_ID!r})\n"
        "    except ValueError as e:\n        print(e)\n"
        "print(time.perf_counter() - start)\n"
    )
    proc, _ = run_python(code, offline_env(tmp_path, "closed_port"), tmp_path)
    *lines, seconds = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stderr[-2000:]
    for line, what in zip(lines, ("model.path", "load_model"), strict=True):
        assert line.startswith(f"{what}: '{HUB_ID}' is a hub id, but the hub cannot be reached")
        assert "cannot reach http://127.0.0.1:" in line and "smollm2-demo" in line, line
    assert float(seconds) < FAST_S, seconds  # the calls, not the imports


def test_cached_repo_loads_offline_from_the_cache(tiny_run, tmp_path):
    model_dir, _ = tiny_run
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    code = (
        "import time\nimport slipstream\n"
        "import slipstream.checkpoint.hf  # torch and the models: imported, not timed\n"
        "from slipstream.checkpoint.tokenizer import load_tokenizer\n"
        "start = time.perf_counter()\n"
        "tok = load_tokenizer('org/tiny')\nmodel = slipstream.load_model('org/tiny')\n"
        "print(model.config.hf['model_type'], model.name_or_path, tok.chat_template is not None)\n"
        "print(time.perf_counter() - start)\n"
    )
    proc, _ = run_python(code, offline_env(tmp_path, "closed_port"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded, seconds = proc.stdout.strip().splitlines()
    assert loaded == "llama org/tiny True" and float(seconds) < FAST_S, proc.stdout
