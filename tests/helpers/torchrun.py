"""torchrun jobs for the tests: the one way a test starts `python -m torch.distributed.run`.

`run_torchrun(args, tmp, timeout=...)` starts torchrun in a session of its own, with a mark in
its environment that every rank (and anything a rank starts) inherits. torchrun starts each
rank in a new session too, so killing torchrun's process group would miss them: on a timeout
every process carrying the mark is SIGKILLed, and so is any still alive after torchrun has
returned by itself; no rank outlives its test. Each rank writes its output to a log of its own
(`--log-dir --redirects 3 --tee 3`; also on torchrun's stdout/stderr, prefixed `[defaultN]:`),
and a failing check shows the last lines of each (`Job.report`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MARK = "SLIPSTREAM_TEST_JOB"  # environment variable naming the job a process belongs to


@dataclass
class Job:
    """A finished (or killed) torchrun job: torchrun's exit status and output, its ranks' logs."""

    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    log_dir: Path
    seconds: float
    survivors: list[int] = field(default_factory=list)  # pids alive after torchrun returned
    signalled_at: float | None = None  # time.time() when `signal_when` sent its signal

    def rank_logs(self) -> dict[int, dict[str, str]]:
        """{local rank: {"stdout": text, "stderr": text}}, from the newest attempt."""
        logs: dict[int, dict[str, str]] = {}
        for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log")):
            rank = logs.setdefault(int(path.parent.name), {})
            rank[path.stem] = path.read_text(errors="replace")
        return logs

    def report(self, lines: int = 25) -> str:
        """Why the job failed, with the last `lines` lines of each rank's stdout and stderr."""
        how = "was killed at its timeout" if self.returncode is None else "exited"
        parts = [f"torchrun {how} (status {self.returncode}) after {self.seconds:.0f} s"]
        if self.survivors:
            parts.append(f"processes alive after torchrun returned (killed): {self.survivors}")
        for rank, streams in sorted(self.rank_logs().items()):
            for name, text in sorted(streams.items()):
                tail = "\n".join(text.splitlines()[-lines:])
                parts.append(f"--- rank {rank} {name}, last {lines} lines:\n{tail}")
        own = [x for x in self.stderr.splitlines() if not x.startswith("[default")]
        parts.append("--- torchrun's own stderr, last lines:\n" + "\n".join(own[-lines:]))
        return "\n".join(parts)


class JobTimedOut(AssertionError):
    """The job ran past its timeout; every process of it has been killed."""

    def __init__(self, job: Job) -> None:
        super().__init__(job.report())
        self.job = job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    args: list[str],
    tmp: Path,
    *,
    timeout: float,
    nproc: int = 2,
    env: dict | None = None,
    signal_when: tuple[Callable[[], bool], int] | None = None,
) -> Job:
    """`torchrun --nproc_per_node nproc ARGS` (a script and its arguments, or `-m module ...`),
    run from the repository root. `signal_when=(ready, signum)`: send `signum` to torchrun
    once `ready()` (polled every 0.2 s) is true. Raises JobTimedOut past `timeout` seconds,
    and AssertionError when a rank outlives torchrun; either way every rank is gone first."""
    tmp.mkdir(parents=True, exist_ok=True)
    log_dir = tmp / f"torchrun-logs-{time.monotonic_ns()}"
    token = uuid.uuid4().hex
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3", *args,
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env[MARK] = token
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    signalled_at = None
    while True:
        left = start + timeout - time.monotonic()
        try:  # retried, communicate loses no output
            stdout, stderr = proc.communicate(timeout=max(min(left, 0.2), 0.01))
            returncode: int | None = proc.returncode
            break
        except subprocess.TimeoutExpired:
            if left <= 0:
                kill_job(proc, token)
                stdout, stderr = proc.communicate(timeout=60)  # closed with the last process
                returncode = None
                break
        if signal_when is not None and signalled_at is None and signal_when[0]():
            proc.send_signal(signal_when[1])  # torchrun alone, as Ctrl-C or a scheduler would
            signalled_at = time.time()
    # torchrun returns once its ranks have exited; any process still marked outlived it.
    survivors = kill_job(proc, token, grace_s=5.0)
    job = Job(returncode, stdout, stderr, log_dir, time.monotonic() - start, survivors)
    job.signalled_at = signalled_at
    if returncode is None:
        raise JobTimedOut(job)
    assert not survivors, job.report()
    return job


def train_job(raw: dict, tmp: Path, *overrides: str, timeout: float = 120) -> Job:
    """`slipstream train` on the config `raw` under torchrun, 2 ranks."""
    config = tmp / f"run-{time.monotonic_ns()}.yaml"
    config.write_text(yaml.safe_dump(raw))
    return run_torchrun(["-m", "slipstream", "train", str(config), *overrides], tmp,
                        timeout=timeout)  # fmt: skip


def check(job: Job) -> None:
    assert job.returncode == 0, job.report()


def kill_job(proc: subprocess.Popen, token: str, *, grace_s: float = 0.0) -> list[int]:
    """SIGKILL torchrun's process group and every process marked with `token` (after
    `grace_s` seconds for them to end on their own); returns the pids that had to be killed
    (beyond torchrun's group). Waits until none is left."""
    deadline = time.monotonic() + grace_s
    while _marked(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:  # unreaped, so its group id cannot be another's yet
        os.killpg(proc.pid, signal.SIGKILL)
    killed: set[int] = set()
    for _ in range(300):  # 30 s at most: SIGKILL cannot be ignored
        pids = _marked(token)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    proc.wait(timeout=30)
    return sorted(killed - {proc.pid})


def _marked(token: str) -> list[int]:
    """Live processes whose environment carries `MARK=token` (zombies have none)."""
    want = f"{MARK}={token}".encode()
    if not os.path.isdir("/proc"):  # not Linux: torchrun's own group is all we can reach
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                environ = Path(entry.path, "environ").read_bytes()
            except OSError:  # gone, or another user's
                continue
            if want in environ.split(b"\0"):
                pids.append(int(entry.name))
    return pids
