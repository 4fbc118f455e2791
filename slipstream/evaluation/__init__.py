"""Evaluation on lm-evaluation-harness tasks (`slipstream eval`, `train.eval_tasks`).

- `scoring.py`: log-likelihood requests as packed, padding-free forwards (torch only);
- `lm.py`: `SlipstreamLM`, slipstream's model as an lm-eval `LM` (imports lm_eval);
- `tasks.py`: task lookup, running, metrics; `command.py`: the CLI.

lm-eval is an optional extra: nothing here imports it until a task runs.
"""
