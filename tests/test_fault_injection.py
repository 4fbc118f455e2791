"""A run SIGKILLed at seeded random points across several checkpoint writes, resumed each time.

Each kill lands on one of the events in helpers/kill_run.py (optimizer steps, torch.save cut
halfway, atomic-writer fsyncs and renames, the manifest, pruning). Every resume must start
from the newest checkpoint that was completely written (the one being written when the kill
came is lost: a fallback to the one before), every loss logged by every process must equal
the uninterrupted run's bit for bit, and the final adapter must be byte-identical.
The figures are in docs/reliability.md.
"""

import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.runs import lora_with_dropout, losses, run_config

from slipstream.config import config_from_dict
from slipstream.train import train
from slipstream.train.metrics import read_metrics
from slipstream.train.state import CHECKPOINT_DIR, list_checkpoints, verify_checkpoint

KILLS, SEED = 10, 20
# Kills a chain takes before its last process runs to the end: a process resumed after the
# last checkpoint may need more events to finish than any kill point, so without this cap
# a chain could be killed for ever.
KILLS_PER_CHAIN = 5


def newest_intact_step(out: Path) -> int:
    intact = [p for p in list_checkpoints(out) if verify_checkpoint(p) is None]
    return int(intact[-1].name.removeprefix("step-")) if intact else 0


def cut_steps(out: Path) -> list[int]:
    """Checkpoints a kill cut mid-write: temporary folders left behind."""
    root = out / CHECKPOINT_DIR
    found = root.glob(".tmp-step-*") if root.is_dir() else []
    return sorted(int(p.name.removeprefix(".tmp-step-")) for p in found)


def launch(config: Path, kill_at: int, note: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "helpers.kill_run", str(config), str(kill_at), str(note)],
        capture_output=True, text=True, env=env, cwd=config.parent,
    )  # fmt: skip


@pytest.mark.slow  # ~14 subprocesses: a few minutes on 2 cores (one thread each)
def test_random_kills_resume_exactly_or_fall_back(tiny_run, tmp_path):
    kw = dict(steps=10, save_every=2, keep_checkpoints=2)
    reference = tmp_path / "reference"
    train(config_from_dict(lora_with_dropout(run_config(tiny_run, reference, **kw))))
    ref_losses = losses(reference)

    # The event count of one whole run, from a run of its own in another folder.
    probe = tmp_path / "probe.yaml"
    raw = {**lora_with_dropout(run_config(tiny_run, tmp_path / "probe", **kw)), "resume": "auto"}
    probe.write_text(yaml.safe_dump(raw))
    done = launch(probe, 0, tmp_path / "note.json")
    assert done.returncode == 0, done.stderr[-3000:]
    events = int(re.search(r"events=(\d+)", done.stdout).group(1))

    rng = random.Random(SEED)
    log, chain = [], 0
    while len(log) < KILLS:  # chains of kills, each until its run gets through
        chain += 1
        out = tmp_path / f"run{chain}"
        config = tmp_path / f"run{chain}.yaml"
        config.write_text(yaml.safe_dump({**raw, "output_dir": str(out)}))
        expected_start = 0
        for attempt in itertools.count():
            note = tmp_path / "note.json"
            note.unlink(missing_ok=True)
            # A quarter of a run's events: about two steps and a checkpoint write per process;
            # 0 (never killed) for the chain's last process.
            kill_at = rng.randint(1, events // 4) if attempt < KILLS_PER_CHAIN else 0
            done = launch(config, kill_at, note)
            said = re.search(r"resuming from \S+ \(step (\d+)\)", done.stderr)
            if said or "step=" in done.stderr:  # (a kill may come before it resumes)
                assert (int(said.group(1)) if said else 0) == expected_start, done.stderr[-3000:]
            if done.returncode == 0:  # got through: the chain is over
                break
            assert done.returncode == -9, done.stderr[-3000:]
            # Every loss this process logged equals the uninterrupted run's.
            for r in read_metrics(out / "metrics.jsonl"):
                if "loss" in r:
                    assert r["loss"] == ref_losses[r["step"]], (r, log)
            newest, cut = newest_intact_step(out), cut_steps(out)
            what = json.loads(note.read_text())
            log.append({"chain": chain, "kill_at": kill_at, "start": expected_start,
                        "event": what["event"], "resume_from": newest, "cut": cut,
                        "fallback": any(step > newest for step in cut)})  # fmt: skip
            expected_start = newest
        assert losses(out) == ref_losses
        name = "adapter_model.safetensors"
        assert (out / name).read_bytes() == (reference / name).read_bytes()
        assert not cut_steps(out) and not list(out.glob(".*tmp*"))  # nothing left behind

    killed = log
    figures = {
        "kills": len(killed),
        "resumed_from_newest": sum(not x["fallback"] for x in killed),
        "fell_back": sum(x["fallback"] for x in killed),
        "checkpoints_cut": sorted({s for x in killed for s in x["cut"]}),
        "events_per_run": events,
        "chains": chain,
    }
    print(json.dumps(figures), json.dumps(log), sep="\n")
    assert len(killed) >= 10 and figures["fell_back"] >= 1, figures
