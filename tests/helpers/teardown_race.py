"""Run under torchrun (2 gloo ranks, CPU) by tests/test_teardown.py: leave the process group
in the state that hung a finished run at exit (issue 25), made certain instead of a race.

A DDP wrapper (its reducer holds the group) is alive, and gloo's worker thread holds the only
reference to a collective's work and tensor: freeing that tensor needs the GIL. Rank 1 joins
the collective 2 s late, so both ranks tear down while it is pending. After a real run's last
barrier the worker frees the barrier's work (and with it earlier collectives' tensors) a
moment after the main thread goes on: the same state, for microseconds. Then:
  old       the teardown before the fix, destroy_process_group() (close() did a barrier
            first); then the wrapper is freed, as the trainer's Run was: the reducer drops
            the group's last reference holding the GIL, ~ProcessGroupGloo joins the worker,
            which waits for the GIL: both ranks hang;
  teardown  slipstream.distributed.teardown() (every end but a completed run's);
  close     slipstream.distributed.close() (a completed run's end).
The wrapper is still referenced during the teardown (as by the Run, or a traceback) and freed
after it.
Each rank writes OUT/started-RANK before its teardown, OUT/rank-RANK.json after it (the
teardown's seconds; the process's thread count before the group and after the teardown).

Usage (from the repository root): torchrun --nproc_per_node 2 -m tests.helpers.teardown_race
MODE OUT
"""

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  loaded by slipstream's imports before its group exists
import torch.distributed as tdist
from torch import nn

from slipstream import distributed as dist

# torch._dynamo loaded after the group (DDP's constructor loads it) keeps references to the
# group's Python object for good: the group is then never freed before exit and the old order
# does not hang. A slipstream run has always loaded it by then.


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main(mode: str, out: Path) -> None:
    before = threads()
    device = dist.init(torch.device("cpu"), timeout_s=60)
    rank = dist.rank()
    model = nn.Linear(4, 4)
    ddp = dist.wrap_model(model, "ddp", device)
    loss = dist.run_through(ddp, lambda m, x: m(x).square().sum(), model, torch.ones(2, 4))
    loss.backward()
    if rank == 1:
        time.sleep(2.0)
    pending = torch.ones(8)
    tdist.all_reduce(pending, async_op=True)  # the work is dropped at once, never waited
    del pending  # now only gloo's worker holds the tensor
    (out / f"started-{rank}").write_text("")
    teardowns = {"old": tdist.destroy_process_group, "teardown": dist.teardown,
                 "close": dist.close}  # fmt: skip
    start = time.monotonic()
    teardowns[mode]()
    del ddp  # as the trainer's Run is freed after its teardown (a traceback's: at exit)
    gc.collect()
    seconds = time.monotonic() - start
    result = {"seconds": seconds, "threads_before": before, "threads_after": threads()}
    (out / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
