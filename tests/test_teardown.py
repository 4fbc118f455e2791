"""How a torchrun job ends (issue 25; docs/reliability.md): every rank exits, in bounded time,
with a non-zero status when the job failed, on 2 gloo ranks.

The teardown itself: a rank tears its group down while gloo's worker holds a collective's
tensor and a DDP wrapper holds the group (helpers/teardown_race.py): `teardown` and `close`
end and join gloo's threads; the order before the fix hangs (slow test). Then the ends of a
real job (helpers/end_paths.py, the CLI under torchrun): a user error and an exception on
one rank, SIGTERM and SIGINT to torchrun, a normal end.
"""

import fcntl
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml
from helpers.runs import run_config
from helpers.torchrun import JobTimedOut, check, run_torchrun

# As modules: run as a script, tests/helpers would come first on sys.path, and its
# tokenizers.py would shadow the tokenizers package.
RACE, END_PATHS = ["-m", "tests.helpers.teardown_race"], ["-m", "tests.helpers.end_paths"]
# From the failure (or the signal) to the last rank's exit. gloo sees a dead peer at once;
# the rest is a checkpoint save and process exit on a loaded 2-core machine (~5 s idle).
EXIT_BOUND_S = 60


@pytest.mark.parametrize("mode", ["teardown", pytest.param("close", marks=pytest.mark.slow)])
def test_teardown_with_pending_work_and_a_wrapper_ends(tmp_path, mode):
    """Both ranks tear down while a collective is pending (rank 1 joins it 2 s late) and a
    DDP wrapper is alive: each waits for the collective, no more, and gloo's threads are
    joined (the group is gone, not kept alive by the wrapper). Before the fix the same
    sequence hung (next test)."""
    check(run_torchrun([*RACE, mode, str(tmp_path)], tmp_path, timeout=120))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["seconds"] < 30, result
        assert result["threads_after"] == result["threads_before"], result


@pytest.mark.slow  # waits out a hang: ~70 s
def test_the_order_before_the_fix_hangs(tmp_path):
    """The reproduction forces the deadlock: destroy_process_group() and then the wrapper
    freed (the trainer before the fix) never ends on either rank. Should torch stop
    deadlocking here, this fails, and the test above no longer proves the fix."""
    with pytest.raises(JobTimedOut) as timed_out:
        run_torchrun([*RACE, "old", str(tmp_path)], tmp_path, timeout=75)
    report = timed_out.value.job.report()
    assert (tmp_path / "started-0").exists() and (tmp_path / "started-1").exists(), report
    assert not list(tmp_path.glob("rank-*.json")), report


def end_config(tiny_run, out: Path, parallel: str, steps: int) -> dict:
    raw = run_config(tiny_run, out, steps=steps, grad_accum=1, save_every=0)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    raw["train"].update(parallel=parallel, dist_timeout_s=60)
    raw["data"]["eval_fraction"] = 0
    return raw


def start_end_path(tiny_run, tmp_path, mode, parallel="ddp", steps=6, **kwargs):
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(end_config(tiny_run, out, parallel, steps)))
    return out, [*END_PATHS, str(config), mode, str(tmp_path)]


def rank_statuses(stderr: str) -> dict[int, int]:
    """{rank: exit status} of the ranks torchrun's failure summary lists."""
    pairs = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(status) for rank, status in pairs}


@pytest.mark.parametrize(
    "mode, parallel",
    [
        ("exception", "ddp"),
        pytest.param("user_error", "ddp", marks=pytest.mark.slow),
        pytest.param("exception", "fsdp", marks=pytest.mark.slow),
        pytest.param("user_error", "fsdp", marks=pytest.mark.slow),
    ],
)
def test_a_failure_on_one_rank_ends_every_rank(tiny_run, tmp_path, mode, parallel):
    """Rank 1 fails in step 3 and says why (a user error: its one line; an exception: its
    traceback). Rank 0, in a collective with it, fails too (gloo: "Connection closed by
    peer"), or torchrun stops it first (SIGTERM: -15). Every rank exits non-zero and so does
    torchrun, soon after the failure; no result is written; the lock is free."""
    out, args = start_end_path(tiny_run, tmp_path, mode, parallel)
    job = run_torchrun(args, tmp_path, timeout=180)
    assert job.returncode == 1, job.report()
    statuses = rank_statuses(job.stderr)
    assert set(statuses) == {0, 1} and 0 not in statuses.values(), job.report()
    failed_at = (tmp_path / "started-1").stat().st_mtime
    assert time.time() - failed_at < EXIT_BOUND_S, job.report()
    logs = job.rank_logs()[1]["stderr"]
    if mode == "user_error":
        assert "slipstream: error: end_paths: a user error on rank 1" in logs, job.report()
        assert "Traceback" not in logs, job.report()
    else:
        assert "RuntimeError: end_paths: an exception on rank 1" in logs, job.report()
    assert not (out / "summary.json").exists()
    assert lock_is_free(out), job.report()


def lock_is_free(out: Path) -> bool:
    """No run holds output_dir's lock: gone (rank 0 released it), or left by a rank 0 that
    torchrun stopped with a signal, its flock gone with the process (the next run takes it
    over, saying so)."""
    path = out / ".slipstream.lock"
    if not path.exists():
        return True
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "signum, parallel",
    [
        (signal.SIGTERM, "ddp"),
        pytest.param(signal.SIGINT, "ddp", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, "fsdp", marks=pytest.mark.slow),
    ],
)
def test_a_signal_to_torchrun_stops_every_rank_with_a_checkpoint(
    tiny_run, tmp_path, signum, parallel
):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C) to torchrun, which passes it to every rank:
    each stops after its step, the checkpoint is saved, every rank exits 128 + signal and
    torchrun exits non-zero; `resume=true` would continue from the checkpoint."""
    out, args = start_end_path(tiny_run, tmp_path, "wait", parallel, steps=2000)
    job = run_torchrun(
        args, tmp_path, timeout=240,
        signal_when=(lambda: all((tmp_path / f"started-{r}").exists() for r in (0, 1)), signum),
    )  # fmt: skip
    assert job.returncode not in (0, None), job.report()
    assert time.time() - job.signalled_at < EXIT_BOUND_S, job.report()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert summary["steps"] < 2000
    assert (out / "checkpoints" / f"step-{summary['steps']:06d}" / "manifest.json").exists()
    expected = f"interrupted by {signal.Signals(signum).name} at step {summary['steps']}"
    assert expected in job.stdout, job.report()
    assert set(rank_statuses(job.stderr).values()) <= {128 + signum}, job.report()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_normal_end_exits_zero(tiny_run, tmp_path, parallel):
    out, args = start_end_path(tiny_run, tmp_path, "normal", parallel)
    check(run_torchrun(args, tmp_path, timeout=180))
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert (out / "adapter_model.safetensors").exists()
    assert not (out / ".slipstream.lock").exists()  # rank 0 removed it
