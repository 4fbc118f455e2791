"""`train.eval_tasks`: lm-evaluation-harness tasks at each eval point of a run.

The tasks are looked up once, before the weights load (an unknown name or a missing lm-eval
is a one-line error then, not after the first steps). At each eval (start, every
`train.eval_every` steps, end) the model in training answers them through `SlipstreamLM`
(evaluation/lm.py) with `train.eval_tasks_limit` documents a task, and one metrics record
`{"step", "eval/<task>/<metric>": value, ...}` goes to metrics.jsonl, TensorBoard and W&B.
A resumed run keeps the records up to its checkpoint's step, as every other line.

Under torchrun every rank runs the same requests with the weights gathered
(`gathered_for_generation`: no collective inside, whatever the ranks' batches), and rank 0
logs.
"""

from __future__ import annotations

import time
from typing import Any

from slipstream.distributed import gathered_for_generation


class EvalTasks:
    """The run's lm-eval tasks; `__call__(model, tokenizer)` -> {"eval/<task>/<metric>": v}."""

    def __init__(self, tasks: list[str], limit: float | None, include_path: str | None) -> None:
        from slipstream.evaluation.tasks import require_lm_eval, task_manager

        require_lm_eval("train.eval_tasks")
        self.tasks, self.limit = tasks, limit
        self.manager = task_manager(
            tasks, include_path, ("train.eval_tasks", "train.eval_tasks_include_path")
        )

    @classmethod
    def of(cls, t: Any) -> EvalTasks | None:
        """From the train section; None without eval_tasks."""
        if not t.eval_tasks:
            return None
        return cls(list(t.eval_tasks), t.eval_tasks_limit, t.eval_tasks_include_path)

    def __call__(self, model: Any, tokenizer: Any) -> dict[str, float]:
        from slipstream.evaluation.lm import SlipstreamLM
        from slipstream.evaluation.tasks import run_tasks, task_metrics

        limit = int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
        started = time.perf_counter()
        with gathered_for_generation(model):
            lm = SlipstreamLM(model, tokenizer, progress=False)
            results = run_tasks(lm, self.tasks, self.manager, limit=limit)
        metrics = task_metrics(results)
        metrics["eval/tasks_time_s"] = time.perf_counter() - started
        return metrics
