"""lm-evaluation-harness tasks on a slipstream model: finding them, running them, reading
their metrics.

- `task_manager(tasks, include_path)`: lm-eval's `TaskManager`. lm-eval's own tasks take
  ~12 s to index (14,686 entries, measured on 2 busy cores), so when every task asked for is
  in `include_path` the index is of that folder alone.
- `run_cli(...)`: `simple_evaluate` as lm-eval's CLI calls it (`slipstream eval`): seeds,
  environment info, the results dict its JSON holds.
- `run_tasks(lm, ...)`: lm-eval's `evaluate` with each task's own few-shot setting (training
  evals): no environment probing (4 s), no stderr bootstrap, and every RNG the run uses left
  as it was, so a run with eval tasks trains on the same random draws as one without.
- `task_metrics(results)`: `{"eval/<task>/<metric>": value}` (lm-eval's metric key, whose
  filter follows a comma when it is not "none"; standard errors left out).

lm-eval is an optional extra (`pip install 'slipstream[eval]'`); `require_lm_eval` says so in
one line.
"""

from __future__ import annotations

import difflib
import functools
import random
from pathlib import Path
from typing import Any

FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


def require_lm_eval(what: str) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{what} needs lm-evaluation-harness: pip install 'slipstream[eval]' "
            "(or pip install lm-eval)"
        ) from None


def load_for_eval(model: str, *, base: str | None = None, device: str = "auto",
                  dtype: str = "auto"):  # fmt: skip
    """(model, tokenizer) of a model folder, GGUF file or hub id, or of a run or adapter
    folder on its base, as `slipstream generate` loads them."""
    import argparse

    from slipstream.generation.commands import load

    return load(argparse.Namespace(model=model, base=base, device=device, dtype=dtype))


def task_manager(tasks: list[str], include_path: str | None,
                 names: tuple[str, str] = ("--tasks", "--include-path")):  # fmt: skip
    """A TaskManager that knows every name in `tasks` (a ValueError naming the first it does
    not, with the closest known names). `names`: how the two settings are called."""
    from lm_eval.tasks import TaskManager

    what, where_key = names
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ValueError(f"{where_key} '{include_path}' is not a folder of task YAMLs")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _unknown(local, tasks):
            return local
    manager = _with_defaults(include_path)
    missing = _unknown(manager, tasks)
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        where = f" nor in {include_path}" if include_path else ""
        raise ValueError(
            f"{what}: lm-eval has no task '{missing[0]}'{where}{hint}; "
            f"list them with `lm-eval ls tasks`, or give {where_key} DIR for your own YAMLs"
        )
    return manager


@functools.cache
def _with_defaults(include_path: str | None) -> Any:
    """lm-eval's own tasks (and `include_path`'s), indexed once a process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _unknown(manager: Any, tasks: list[str]) -> list[str]:
    return [t for t in tasks if not Path(t).is_file() and not manager.match_tasks([t])]


def run_cli(lm: Any, tasks: list[str], manager: Any, *, limit: float | None,
            num_fewshot: int | None, log_samples: bool = False) -> dict:  # fmt: skip
    """lm-eval's `simple_evaluate` on `lm` -> its results dict (what lm-eval writes)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                           num_fewshot=num_fewshot, log_samples=log_samples)  # fmt: skip


def run_tasks(lm: Any, tasks: list[str], manager: Any, *, limit: float | None = None,
              num_fewshot: int | None = None, log_samples: bool = False) -> dict:  # fmt: skip
    """lm-eval's `evaluate` of the LM `lm` on `tasks` (few-shot: `num_fewshot`, else each
    task's own, else 0; lm-eval's few-shot seed), no stderr bootstrap, every RNG as before."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate

    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda):
            loaded = manager.load(tasks)
            for task in loaded["tasks"].values():
                if num_fewshot is not None and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
            return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0,
                            log_samples=log_samples, verbosity="WARNING")  # fmt: skip
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


def task_metrics(results: dict) -> dict[str, float]:
    """`{"eval/<task>/<metric>": value}` of every task and group in an lm-eval results dict
    (numbers only; `<metric>,<filter>` where the filter is not "none")."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or "_stderr," in key:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            out[f"eval/{task}/{metric if filt == 'none' else key}"] = float(value)
    return out
