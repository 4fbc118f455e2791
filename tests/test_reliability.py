"""Faults a long run meets, each ending in one line and exit 2 with nothing safe lost.

Atomic writes (fsync, rename, fsync of the folder) that leave files as readable as the
umask says; a full disk (ENOSPC injected into the writers, and a real 1 MiB tmpfs where the
machine can mount one); a pickled object planted in state.pt (refused, never run); damaged
checkpoints (fallback to the newest intact one, exit 2 when none is).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.planted import Planted
from helpers.runs import losses, run_config

from slipstream import cli
from slipstream.checkpoint import atomic
from slipstream.checkpoint.atomic import DiskFullError, atomic_write_text
from slipstream.config import config_from_dict
from slipstream.train import train
from slipstream.train.state import (
    MANIFEST,
    list_checkpoints,
    read_state,
    verify_checkpoint,
    write_manifest,
)


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error printed"
    return err[-1]


def lora(raw: dict) -> dict:
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    return raw


def test_outputs_are_readable_as_the_umask_says(tiny_run, tmp_path):
    """mkstemp makes 0600 files: the adapter, config.json, summary.json... were unreadable
    to the group. Every file the run writes must now be 0644 under umask 0022."""
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        train(config_from_dict(lora(run_config(tiny_run, out, steps=2, save_every=1))))
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    wanted = ["adapter_model.safetensors", "adapter_config.json", "summary.json", "config.yaml"]
    wanted += ["metrics.jsonl", "tokenizer.json", "state.pt", MANIFEST]
    for name in wanted:
        assert name in names, name
    modes = {str(p.relative_to(out)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o644"}, modes
    assert not [p for p in out.rglob(".*tmp*")]  # no temporary file left behind


def test_atomic_write_fsyncs_the_file_then_the_folder(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert len(synced) == 2 and ".a.json." in synced[0] and synced[1] == str(tmp_path)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def fail_after(real, calls: int, error: BaseException):
    """`real` until its `calls`-th call, which writes half a file and raises `error`."""
    count = {"n": 0}

    def wrapped(obj, f, *args, **kwargs):
        count["n"] += 1
        if count["n"] == calls:
            Path(f).write_bytes(b"\0" * 1000)
            raise error
        return real(obj, f, *args, **kwargs)

    return wrapped


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(
    tiny_run, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=6, save_every=2)
    # torch.save loses the errno (it says "unexpected pos"): ENOSPC as the OS gives it.
    enospc = OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", fail_after(torch.save, 2, enospc))
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    line = error_line(capsys)
    assert line.startswith("slipstream: error: disk full: writing ")
    assert str(out / "checkpoints" / "step-000004") in line and " needs " in line
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert verify_checkpoint(list_checkpoints(out)[0]) is None
    assert read_state(list_checkpoints(out)[0])["step"] == 2
    assert not list((out / "checkpoints").glob(".tmp*"))  # the partial folder is gone


def test_disk_full_at_the_final_save_names_the_file(tiny_run, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    from slipstream.checkpoint import hf

    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=4, save_every=2)
    full = SafetensorError("I/O error: No space left on device (os error 28)")  # as it says it
    monkeypatch.setattr(hf, "save_file", fail_after(hf.save_file, 1, full))
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    line = error_line(capsys)
    assert f"disk full: writing {out / 'model.safetensors'} needs " in line
    assert not (out / "model.safetensors").exists()
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    assert verify_checkpoint(list_checkpoints(out)[0]) is None


def test_disk_full_precheck_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 100)
    with pytest.raises(DiskFullError, match=r"needs 1\.0 KiB but only 100 bytes is free"):
        atomic_write_text(tmp_path / "big.txt", "x" * 1024)
    assert list(tmp_path.iterdir()) == []


SMALL_FS_RUN = """
import json, sys
from pathlib import Path
from slipstream import cli
from slipstream.train.state import list_checkpoints, read_state, verify_checkpoint
rc = cli.main(["train", sys.argv[1]])
out = Path(sys.argv[2])
found = list_checkpoints(out)
print(json.dumps({"rc": rc, "checkpoints": [p.name for p in found],
                  "intact": [verify_checkpoint(p) is None for p in found],
                  "steps": [read_state(p)["step"] for p in found]}))
"""


def can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.slow  # a subprocess: ~50 s on the loaded 2-core machine, most of it imports
@pytest.mark.skipif(not can_mount_tmpfs(), reason="no user+mount namespaces for a tmpfs")
def test_disk_full_on_a_real_small_file_system(tiny_run, tmp_path):
    """Full fine-tuning with a checkpoint each step into a 1 MiB tmpfs (a checkpoint is
    ~0.5 MiB): the disk fills at the second or third one; exit 2 naming it; the ones before
    stay intact and loadable."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = mnt / "run"
    raw = run_config(tiny_run, out, steps=8, save_every=1, keep_checkpoints=8)
    config = write_yaml(tmp_path / "run.yaml", raw)
    script = tmp_path / "small_fs_run.py"
    script.write_text(SMALL_FS_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = f'exec "{sys.executable}" "{script}" "{config}" "{out}"'
    shell = f'mount -t tmpfs -o size=1m tmpfs "{mnt}" && {run}'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    errors = [x for x in done.stderr.splitlines() if x.startswith("slipstream: error:")]
    assert result["rc"] == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "disk full: writing " in errors[0] and " needs " in errors[0], errors[0]
    assert result["checkpoints"] and all(result["intact"]), result
    assert result["steps"] == list(range(1, len(result["steps"]) + 1))


def test_a_planted_pickle_is_refused_and_never_run(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=4, save_every=2)
    train(config_from_dict(raw))
    checkpoint = list_checkpoints(out)[-1]
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    marker = tmp_path / "pwned"
    state["extra"]["note"] = Planted(marker)
    torch.save(state, checkpoint / "state.pt")
    write_manifest(checkpoint, 2)  # an intact checkpoint, as someone else would ship it
    raw["resume"] = str(checkpoint)
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    line = error_line(capsys)
    assert f"refused {checkpoint / 'state.pt'}" in line and "(it calls getattr)" in line, line
    assert not marker.exists()
    torch.load(checkpoint / "state.pt", weights_only=False)  # the plant is live:
    assert marker.exists()  # the old loader would have run it


def test_damaged_latest_checkpoint_falls_back_to_the_previous(tiny_run, tmp_path, capsys):
    split = tmp_path / "split"
    # Checkpoints at 2 and 4, then the run is over: resuming redoes steps 5-6 (or 3-6).
    train(config_from_dict(run_config(tiny_run, split, steps=6, save_every=2)))
    straight = losses(split)
    latest = list_checkpoints(split)[-1]
    state_pt = latest / "state.pt"
    size = state_pt.stat().st_size
    os.truncate(state_pt, size // 2)
    capsys.readouterr()
    raw = {**run_config(tiny_run, split, steps=6, save_every=2), "resume": True}
    summary = train(config_from_dict(raw))
    said = capsys.readouterr().err
    assert (
        f"checkpoint {latest} is damaged (state.pt has {size // 2} bytes, the manifest says "
        f"{size}); trying the one before it"
    ) in said
    assert "(step 2)" in said
    assert summary["status"] == "completed"
    resumed = losses(split)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


def test_no_intact_checkpoint_exits_2(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=6, save_every=2)
    train(config_from_dict(raw))
    first, second = list_checkpoints(out)
    (first / "state.pt").write_bytes(b"garbage")
    data = bytearray((second / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit, the size unchanged
    (second / "state.pt").write_bytes(bytes(data))
    raw["resume"] = True
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    line = error_line(capsys)
    assert f"no intact checkpoint in {out / 'checkpoints'}" in line
    assert "step-000004: state.pt does not match its checksum" in line
    assert "step-000002: state.pt has 7 bytes" in line


# --- non-finite steps -------------------------------------------------------------------


def nan_grads(params, bad: bool) -> None:
    for p in params:
        p.grad = torch.full_like(p, float("nan") if bad else 0.5)


def test_fused_adamw_skips_a_non_finite_step_on_the_device():
    """found_inf: weights, both moments and the step count stay as they were; no sync."""
    from slipstream.debug import count_syncs
    from slipstream.train.nonfinite import NonFiniteGuard

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = NonFiniteGuard(opt, torch.device("cpu"), limit=1, skipped=0)
    assert guard.gated
    loss = torch.tensor(2.0)
    nan_grads([p], bad=False)
    guard.step(opt, 1, loss, torch.linalg.vector_norm(p.grad))
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    nan_grads([p], bad=True)
    with count_syncs() as syncs:
        kept = guard.step(opt, 2, torch.tensor(float("nan")), torch.linalg.vector_norm(p.grad))
    assert syncs.total == 0, str(syncs)
    assert kept.item() == 0.0 and torch.equal(p, before[0])
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[1][k]), k
    # The next finite step is the second real one: as a plain AdamW that never saw the NaN.
    q = torch.nn.Parameter(before[0].clone())
    ref = torch.optim.AdamW([q], lr=0.1, fused=True)
    ref.state[q] = {k: v.clone() for k, v in before[1].items()}
    nan_grads([p], bad=False)
    nan_grads([q], bad=False)
    guard.step(opt, 3, loss, torch.linalg.vector_norm(p.grad))
    ref.step()
    assert torch.equal(p, q)
    assert guard.check_now() == 1  # one skipped, within the limit
    nan_grads([p], bad=True)
    guard.step(opt, 4, loss, torch.linalg.vector_norm(p.grad))
    with pytest.raises(ValueError, match=r"non-finite more than train.skip_nonfinite=1 at step 4"):
        guard.check_now()


def test_a_non_finite_step_without_a_gate_is_skipped_by_the_host_check():
    from slipstream.train.nonfinite import NonFiniteGuard

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    guard = NonFiniteGuard(opt, torch.device("cpu"), limit=2, skipped=0)
    assert not guard.gated and guard.host_checked
    nan_grads([p], bad=True)
    before = p.detach().clone()
    guard.step(opt, 1, torch.tensor(1.0), torch.linalg.vector_norm(p.grad))
    assert torch.equal(p, before) and not opt.state
    assert guard.check_now() == 1


# --- one run per output dir -------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from slipstream.train.lock import OutputDirLock
assert OutputDirLock(sys.argv[1]).acquire() is None
print("held", flush=True)
time.sleep(120)
"""


def hold_lock_elsewhere(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path, capsys):
    import socket

    from slipstream.train.lock import LOCK_FILE, OutputDirLock

    holder = hold_lock_elsewhere(tmp_path)
    try:
        why = OutputDirLock(tmp_path).acquire()
        assert why and f"in use by another run (pid {holder.pid} on {socket.gethostname()}" in why
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK_FILE).is_file()  # SIGKILL: the file stays, the flock is gone
    lock = OutputDirLock(tmp_path)
    assert lock.acquire() is None
    said = capsys.readouterr().err
    assert said.count(f"taking over the stale lock of pid {holder.pid}") == 1
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert OutputDirLock(tmp_path).acquire() is not None  # held: a second one is refused
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    again = OutputDirLock(tmp_path)
    assert again.acquire() is None and capsys.readouterr().err == ""  # clean: nothing said
    again.release()


def test_lock_without_flock_checks_the_pid(tmp_path, monkeypatch):
    import socket

    from slipstream.train import lock as lock_module
    from slipstream.train.lock import LOCK_FILE, OutputDirLock

    monkeypatch.setattr(lock_module, "_try_flock", lambda fd: None)  # e.g. an NFS mount
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    try:
        for pid, other_host, refused in [(live.pid, host, True), (dead.pid, host, False),
                                         (dead.pid, "node7", True)]:  # fmt: skip
            (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": other_host}))
            lock = OutputDirLock(tmp_path)
            why = lock.acquire()
            assert (why is not None) == refused, (pid, other_host, why)
            if other_host != host:
                assert f"pid {pid} on node7" in why and f"delete {tmp_path / LOCK_FILE}" in why
            lock.release()
    finally:
        live.kill()
        live.wait()


def train_with_nan_at(cfg, steps: set[int]):
    """`train(cfg)` with the loss times NaN in optimizer steps `steps` (so its gradients are
    NaN too), as a bf16 overflow would make it."""
    from slipstream.checkpoint import hf

    calls = {"n": 0}
    per_step = cfg.train.grad_accum
    real_load = hf.load_model

    def load_and_hook(*args, **kwargs):
        model = real_load(*args, **kwargs)
        real_loss = model.loss

        def loss(*a, **k):
            value = real_loss(*a, **k)
            if model.training:
                calls["n"] += 1
                if (calls["n"] - 1) // per_step + 1 in steps:
                    if isinstance(value, tuple):  # return_parts=True: (loss, parts)
                        return value[0] * float("nan"), value[1]
                    return value * float("nan")
            return value

        model.loss = loss
        return model

    hf.load_model = load_and_hook
    try:
        return train(cfg)
    finally:
        hf.load_model = real_load


def test_non_finite_step_stops_the_run_without_saving_it(tiny_run, tmp_path):
    """Logged every 2 steps, saved every step: NaN in step 3 (the weights turn NaN: CPU
    AdamW has no device-side gate) stops the run at step 3's save, before anything is
    written; step 2 stays the resume point."""
    from slipstream.train.nonfinite import NonFiniteError

    out = tmp_path / "run"
    cfg = config_from_dict(run_config(tiny_run, out, steps=6, log_every=2, save_every=1))
    with pytest.raises(NonFiniteError, match=r"^non-finite at step 3 \(loss nan, grad_norm nan\)"):
        train_with_nan_at(cfg, {3})
    assert [p.name for p in list_checkpoints(out)] == ["step-000001", "step-000002"]
    for p in list_checkpoints(out):
        assert all(v.isfinite().all() for v in read_state(p)["model"].values())
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()
    assert sorted(losses(out)) == [2]  # step 4's log line never came
    from slipstream.train.lock import LOCK_FILE

    assert not (out / LOCK_FILE).exists()  # released on the error path too


def test_skip_nonfinite_skips_counts_and_then_stops(tiny_run, tmp_path):
    from slipstream.train.nonfinite import NonFiniteError

    out = tmp_path / "run"
    raw = run_config(tiny_run, out, steps=6, skip_nonfinite=2)
    summary = train_with_nan_at(config_from_dict(raw), {2, 5})
    assert summary["status"] == "completed" and summary["skipped_steps"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped_steps"] for r in lines if "loss" in r}
    assert skipped == {1: 0, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2}
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines if "loss" in r)
    from safetensors.torch import load_file

    assert all(v.isfinite().all() for v in load_file(out / "model.safetensors").values())
    raw = run_config(tiny_run, tmp_path / "again", steps=6, skip_nonfinite=2)
    with pytest.raises(NonFiniteError, match=r"more than train.skip_nonfinite=2 at step 4"):
        train_with_nan_at(config_from_dict(raw), {2, 3, 4})


def test_second_run_into_a_busy_output_dir_exits_2(tiny_run, tmp_path, capsys):
    import socket

    out = tmp_path / "run"
    out.mkdir()
    holder = hold_lock_elsewhere(out)
    try:
        config = write_yaml(tmp_path / "run.yaml", run_config(tiny_run, out, steps=2))
        assert cli.main(["train", str(config)]) == 2
        line = error_line(capsys)
        assert f"is in use by another run (pid {holder.pid} on {socket.gethostname()}" in line
        assert not (out / "config.yaml").exists()  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(["train", str(config)]) == 0  # the holder died: its lock is taken over
    assert capsys.readouterr().err.count("taking over the stale lock") == 1
