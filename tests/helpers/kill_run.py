"""`python -m helpers.kill_run CONFIG K NOTE`: `slipstream train CONFIG`, SIGKILLed at event K.

Events are the points where a kill does the most harm: each optimizer step (the clip), each
`torch.save` (killed halfway through its bytes), each write and fsync of the atomic writer,
the manifest, each rename (before and after) and each folder removal (checkpoint pruning).
Before dying the process writes NOTE (the event's name and argument). K = 0: never killed;
the event count is printed at the end, for the test to draw K from.
"""

import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

from slipstream import cli
from slipstream.checkpoint import adapter as adapter_file
from slipstream.checkpoint import atomic
from slipstream.train import state

COUNT = {"n": 0}


def event(name: str, arg: object, kill_at: int, note: Path, before_death=None) -> None:
    COUNT["n"] += 1
    if COUNT["n"] == kill_at:
        note.write_text(json.dumps({"event": name, "arg": str(arg), "n": COUNT["n"]}))
        if before_death is not None:
            before_death()
        os.kill(os.getpid(), signal.SIGKILL)


def wrap(module, name: str, kill_at: int, note: Path, after: bool = False) -> None:
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        event(name, args[0] if args else "", kill_at, note)
        result = real(*args, **kwargs)
        if after:
            event(name + ":after", args[0] if args else "", kill_at, note)
        return result

    setattr(module, name, wrapped)


def main() -> int:
    config, kill_at, note = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        def half_written():  # the bytes a kill mid-write leaves behind
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            Path(f).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])

        event("torch.save", f, kill_at, note, before_death=half_written)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    wrap(torch.nn.utils, "clip_grad_norm_", kill_at, note)
    wrap(os, "replace", kill_at, note, after=True)
    wrap(shutil, "rmtree", kill_at, note)
    wrap(atomic, "fsync_path", kill_at, note)
    wrap(state, "fsync_path", kill_at, note)
    wrap(state, "write_manifest", kill_at, note)
    wrap(adapter_file, "save_file", kill_at, note)
    rc = cli.main(["train", config])
    print(f"events={COUNT['n']}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
