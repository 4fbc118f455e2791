"""Supervised fine-tuning: next-token cross-entropy on the labelled tokens (assistant turns by
default), summed per micro-batch and normalised by the labelled-token count of the step.

A MoE router's load-balancing loss joins the training loss as transformers adds it:
`model.loss` (reduction "sum") adds `coef * aux * N` (N the micro-batch's labelled tokens),
so after the loop's one division by the step's labels each micro-batch weighs
`loss + coef * aux` as in transformers. `aux_loss` is reported label-weighted the same way.
In eval (model.eval()) the loss is the cross-entropy alone, so eval_ppl stays a perplexity.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.objectives.base import Objective


class SFT(Objective):
    """Labelled-token cross-entropy over packed chat or text examples."""

    name = "sft"
    perplexity = True
    metric_names = ("aux_loss",)  # MoE models in training only

    def __init__(self, cfg: Any = None) -> None:
        """`cfg` (a RunConfig) sets the tokenizing options; without one only the loss side
        (collate, weight, micro_batch_loss) is usable, as from the Python API."""
        self.options: dict[str, Any] = {}
        if cfg is None:
            return
        d, t = cfg.data, cfg.train
        self.options = dict(
            format=d.format, train_on=d.train_on, overlong=d.overlong, strict=d.strict,
            num_proc=d.num_proc,
            max_tokens=min(d.max_tokens or t.tokens_per_batch, t.tokens_per_batch),
            # The setting that sets the limit, named when every example is over it.
            limit_name="data.max_tokens"
            if d.max_tokens is not None and d.max_tokens < t.tokens_per_batch
            else "train.tokens_per_batch",
        )  # fmt: skip
        self.model_path = cfg.model.path

    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        """(list[Example], DataReport): chat template, assistant-only labels (data/labels.py);
        image rows through the checkpoint's image processor (data/vision.py)."""
        from slipstream.data import tokenize_rows

        images = self._images(tokenizer)
        return tokenize_rows(rows, tokenizer, first_row=first_row, images=images, **self.options)

    def _images(self, tokenizer: Any) -> Any:
        """The checkpoint's image side (None for a text model), built once."""
        if not hasattr(self, "_image_side"):
            from slipstream.data.vision import run_image_side

            self._image_side = run_image_side(getattr(self, "model_path", None), tokenizer)
        return self._image_side

    def length(self, example: Any) -> int:
        return len(example.input_ids)

    def collate(self, examples: list[Any]) -> Any:
        from slipstream.data import collate

        return collate(examples)

    def weight(self, batch: Any) -> int:
        return batch.num_labels

    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed cross-entropy (+ coef * aux * N in training); the LM head runs on the
        labelled positions only. Hand-built batches without positions take the full path."""
        from slipstream.data.vision import image_inputs

        positions = getattr(batch, "label_positions", None)
        images = image_inputs(getattr(batch, "fields", {}))
        loss, parts = model.loss(
            batch.input_ids, batch.labels, batch.seq, reduction="sum", label_positions=positions,
            return_parts=True, **({"images": images} if images else {}),
        )  # fmt: skip
        if "aux_loss" not in parts:
            return loss, {}
        if not model.training:
            return parts["lm_loss"], {}
        return loss, {"aux_loss": parts["aux_loss"]}
