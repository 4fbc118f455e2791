"""A training checkpoint as the result its run would have saved: for `slipstream export` of
`RUN/checkpoints/step-N` (a run stopped before its end, or an earlier step of a finished one).

A checkpoint's `state.pt` holds the trainable tensors by parameter name and the run's config.
We build the model as the run did (on the CPU, without checkpointing, compile or prepacking; a QLoRA
base unquantised: the adapter does not depend on it), put those tensors in, and save what the
run saves at its end (the PEFT adapter or the full model, and the tokenizer with the run's
chat template) into a folder that the usual export then reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from slipstream.config import RunConfig, moved_keys
from slipstream.train.setup import add_tokens, build_model, save_result, set_chat_template
from slipstream.train.state import CheckpointError, read_state, verify_checkpoint


def write_result(checkpoint: str | Path, into: Path) -> RunConfig:
    """Save checkpoint `checkpoint`'s adapter or model and tokenizer into `into`; returns the
    run's config."""
    from slipstream.checkpoint.tokenizer import load_tokenizer

    checkpoint = Path(checkpoint)
    reason = verify_checkpoint(checkpoint)
    if reason:
        raise CheckpointError(f"export: checkpoint {checkpoint} is damaged ({reason})")
    state = read_state(checkpoint)
    if "model" not in state:
        raise ValueError(
            f"export: checkpoint {checkpoint} was written sharded (FSDP2, "
            f"{state.get('world_size', '?')} processes); resume the run to its end "
            "(resume=true) and export the run folder"
        )
    cfg = RunConfig.model_validate(moved_keys(state["extra"]["config"], say=False))
    train = cfg.train.model_copy(
        update={
            "activation_checkpointing": "none",
            "compile": False,
            "device": "cpu",
            "prepack": False,
        }  # fmt: skip
    )
    model_cfg = cfg.model.model_copy(update={"quantization": "none"})
    if cfg.train.finetune == "full":  # the weights in the dtype they were trained in
        dtype = next(iter(state["model"].values())).dtype
        model_cfg = model_cfg.model_copy(update={"dtype": str(dtype).removeprefix("torch.")})
    cfg = cfg.model_copy(update={"train": train, "model": model_cfg})
    tokenizer = load_tokenizer(cfg.model.path)
    set_chat_template(tokenizer, cfg.data.chat_template)
    add_tokens(tokenizer, cfg.model.add_tokens)
    model = build_model(cfg, torch.device("cpu"), tokenizer)
    params = dict(model.named_parameters())
    unknown = [n for n in state["model"] if n not in params]
    if unknown:
        raise ValueError(
            f"export: checkpoint {checkpoint} has parameter '{unknown[0]}' that the model of "
            f"its config ({cfg.model.path}) lacks; was the base changed since the run?"
        )
    with torch.no_grad():
        for name, value in state["model"].items():
            params[name].copy_(value)
    save_result(model, tokenizer, into, cfg)
    return cfg
