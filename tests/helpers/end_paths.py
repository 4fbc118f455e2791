"""Run under torchrun by tests/test_teardown.py: `slipstream train CONFIG` (the CLI's own
entry, exit status included), ending as MODE says:
  normal      as configured;
  user_error  rank 1 raises ValueError in its 3rd step (exit 2, one line);
  exception   rank 1 raises RuntimeError there (exit 1, a traceback);
  wait        as configured (the test signals the job once OUT/started exists).
Every rank writes OUT/started-RANK at its 2nd step (training is under way).

Usage (from the repository root): torchrun --nproc_per_node 2 -m tests.helpers.end_paths
CONFIG MODE OUT
"""

import sys
from pathlib import Path

from slipstream import distributed as dist
from slipstream.cli import main
from slipstream.train import loop


def inject(mode: str, out: Path) -> None:
    real, calls = loop.accumulate_gradients, [0]

    def accumulate_gradients(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            (out / f"started-{dist.rank()}").write_text("")
        if calls[0] == 3 and dist.rank() == 1:
            if mode == "user_error":
                raise ValueError("end_paths: a user error on rank 1")
            if mode == "exception":
                raise RuntimeError("end_paths: an exception on rank 1")
        return real(*args, **kwargs)

    loop.accumulate_gradients = accumulate_gradients


if __name__ == "__main__":
    config, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode not in ("normal", "user_error", "exception", "wait"):
        raise SystemExit(f"mode {mode!r}: use normal, user_error, exception or wait")
    inject(mode, out)
    raise SystemExit(main(["train", config]))
