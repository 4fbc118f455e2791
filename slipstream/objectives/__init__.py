"""Training objectives: how rows become examples, examples a packed batch, and a batch a
loss. One trainer runs them all (slipstream/train/loop.py); `train.objective` picks one.

An objective is an object with these members (the contract in docs/dev/INTERFACES.md):

    name: str                                       the train.objective value
    perplexity: bool                                eval logs eval_ppl = exp(eval_loss)
    tokenize(rows, tokenizer, first_row) -> (examples, DataReport)
    length(example) -> int                          tokens it takes in a packed batch
    collate(examples) -> batch                      .input_ids, .seq, .to(device)
    weight(batch) -> int                            host int: the loss normaliser's share
    micro_batch_loss(model, batch) -> (loss_sum, {metric: sum})   device tensors, no sync

`OBJECTIVES` maps each name to the class that implements it ("module:Class"), built from
the run config as `Class(cfg)`. Imported only when a run starts, so the config can check a
name without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

OBJECTIVES: dict[str, str] = {
    "sft": "slipstream.objectives.sft:SFT",
    "dpo": "slipstream.objectives.preference:Preference",
    "orpo": "slipstream.objectives.preference:Preference",
    "simpo": "slipstream.objectives.preference:Preference",
    "grpo": "slipstream.objectives.grpo:GRPO",
}


def build_objective(cfg: Any) -> Any:
    """The objective `cfg.train.objective` names, built from the run config."""
    name = cfg.train.objective
    if name not in OBJECTIVES:
        raise ValueError(f"train.objective = {name!r}; use one of {', '.join(OBJECTIVES)}")
    module, cls = OBJECTIVES[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
