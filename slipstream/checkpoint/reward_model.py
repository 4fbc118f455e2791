"""Reward models on disk, in the layouts transformers and peft load unchanged.

- Full (`save_reward_model`): transformers' `*ForSequenceClassification` checkpoint with
  num_labels=1: the backbone's `model.*` tensors (no LM head), `score.weight`, and a
  config.json naming that class, with `pad_token_id` (transformers scores the rightmost
  token that is not the pad: models/score_head.py). `AutoModelForSequenceClassification.
  from_pretrained(DIR)` gives our scores.
- LoRA (`save_reward_adapter`): a PEFT adapter with `task_type: SEQ_CLS` and
  `modules_to_save: [score]`, the head as `base_model.model.score.weight`, as peft saves a
  LoRA sequence classifier. Load it on `AutoModelForSequenceClassification.from_pretrained(
  BASE, num_labels=1, pad_token_id=PAD)` with `PeftModel.from_pretrained`; PAD (the pad id
  the scores were trained with) is in the weights file's metadata (`slipstream.pad_token_id`)
  and is the saved tokenizer's pad id.

`load_reward_model(dir)` reads either back into a slipstream model with its `score` head;
`model.score_pad_token_id` is the pad id its scores use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from slipstream.checkpoint.atomic import atomic_write_text
from slipstream.checkpoint.hf import hf_state, load_with_head, write_tensors
from slipstream.checkpoint.hf_config import current_config
from slipstream.models.score_head import add_score_head

HEAD = "score"
HEAD_WEIGHT = "score.weight"
ADAPTER_HEAD_KEY = "base_model.model.score.weight"  # peft's key for modules_to_save=[score]
PAD_KEY = "slipstream.pad_token_id"  # in the adapter's safetensors metadata


def sequence_classifier_class(model_type: str) -> str:
    """transformers' `*ForSequenceClassification` class name for `model_type`, or a one-line
    ValueError when it has none (AutoModelForSequenceClassification could not load it)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES,
    )

    name = NAMES.get(model_type)
    if name is None:
        raise ValueError(
            f"train.objective=reward: transformers has no sequence-classification class for "
            f"model_type {model_type!r}, so AutoModelForSequenceClassification could not load "
            "the reward model; use a model of another type"
        )
    return name


def reward_config(hf: dict, dtype: str, pad_token_id: int | None) -> dict:
    """config.json of the reward model: the backbone's, as its `*ForSequenceClassification`
    with one label and the pad id the scores use."""
    out = current_config(hf, dtype)
    out["architectures"] = [sequence_classifier_class(hf.get("model_type", ""))]
    out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    out.pop("num_labels", None)  # transformers derives it from id2label
    out["pad_token_id"] = pad_token_id
    return out


def save_reward_model(model: nn.Module, out: str | os.PathLike, pad_token_id: int | None) -> Path:
    """Write the full reward model (module docstring) into `out`; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t for n, t in hf_state(model) if n != "lm_head.weight"}
    lora = [n for n in state if "lora_" in n or ".base_layer." in n]
    if lora:
        raise ValueError(f"save_reward_model: merge the LoRA layers first ({lora[0]})")
    dtype = next(iter(state.values())).dtype
    state[HEAD_WEIGHT] = model.score.weight.detach().float()
    write_tensors(state, out)
    hf = reward_config(model.config.hf, str(dtype).removeprefix("torch."), pad_token_id)
    atomic_write_text(out / "config.json", json.dumps(hf, indent=2, sort_keys=True))
    return out


def save_reward_adapter(
    model: nn.Module,
    out: str | os.PathLike,
    pad_token_id: int | None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write the LoRA reward model as a PEFT adapter with the head in modules_to_save."""
    from slipstream.checkpoint.adapter import save_adapter

    sequence_classifier_class(model.config.model_type)
    head = {ADAPTER_HEAD_KEY: model.score.weight.detach().float().cpu().contiguous()}
    metadata = {PAD_KEY: json.dumps(pad_token_id)}
    return save_adapter(
        model, out, base_model_name_or_path, extra_tensors=head, extra_metadata=metadata,
        extra_config={"task_type": "SEQ_CLS", "modules_to_save": [HEAD]},
    )  # fmt: skip


def is_reward_adapter(path: Path) -> bool:
    config = path / "adapter_config.json"
    if not config.is_file():
        return False
    try:
        return HEAD in (json.loads(config.read_text()).get("modules_to_save") or [])
    except ValueError:
        return False


def load_reward_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    implementation: str = "auto",
) -> nn.Module:
    """A reward model folder (full or adapter, module docstring) as a slipstream model with
    its `score` head and `score_pad_token_id` (absent for an adapter that does not record it:
    the tokenizer's pad id then, as TRL trains); a one-line ValueError for anything else.
    `implementation`: an adapter's base model family, as `load_model`'s."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return _load_adapter(path, dtype, device, implementation)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: no config.json or adapter_config.json: not a reward model")
    hf = json.loads(config.read_text())
    if len(hf.get("id2label") or {"0": 0, "1": 1}) != 1:
        raise ValueError(
            f"{config}: not a reward model (a sequence classifier with one label); "
            "train one with train.objective=reward"
        )
    model, head = load_with_head(path, HEAD_WEIGHT, dtype=dtype, device=device)
    add_score_head(model, head)
    model.score_pad_token_id = hf.get("pad_token_id")
    return model


def _load_adapter(path: Path, dtype: Any, device: Any, implementation: str) -> nn.Module:
    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.sources import adapter_base

    if not is_reward_adapter(path):
        raise ValueError(
            f"{path}: a PEFT adapter without a score head (modules_to_save: [score]); "
            "not a reward model"
        )
    weights = path / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        if ADAPTER_HEAD_KEY not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            raise ValueError(f"{weights}: no {ADAPTER_HEAD_KEY} tensor: the score head is missing")
        head = f.get_tensor(ADAPTER_HEAD_KEY)
        metadata = f.metadata() or {}
    model = load_model(adapter_base(path), dtype=dtype, device=device,
                       implementation=implementation)  # fmt: skip
    load_adapter(model, path, modules_to_save=(HEAD, "classifier"))
    add_score_head(model, head)
    if PAD_KEY in metadata:  # else (peft's or TRL's adapter) the caller takes the tokenizer's
        model.score_pad_token_id = json.loads(metadata[PAD_KEY])
    return model
