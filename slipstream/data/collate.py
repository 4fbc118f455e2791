"""Collator: packed examples -> one flat batch with labels shifted within each sequence.

`labels[t]` is the target of position t: `input_ids[t+1]` when token t+1 is a target of the
same sequence, else -100. Each sequence's last position is -100, so no label crosses a packed
boundary. Everything is built on the host from Python lists; `input_ids` and `labels` share
one (pinned, when CUDA is present) buffer so `Batch.to(device)` is one non-blocking copy for
the tokens plus one for the `SeqInfo`.

Shapes: T = total tokens in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from slipstream.data.labels import Example
from slipstream.ops.packing import SeqInfo

IGNORE_INDEX = -100


@dataclass
class Batch:
    """input_ids_T, labels_T (int64), seq boundaries, and the host count of labels != -100."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq: SeqInfo
    num_labels: int
    _both_2T: torch.Tensor | None = field(default=None, repr=False)  # rows: input_ids, labels

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`: non-blocking copies from the (pinned) host buffer."""
        device = torch.device(device)
        both_2T = self._both_2T
        if both_2T is None:
            both_2T = torch.stack([self.input_ids, self.labels])
        if device.type == "cuda" and not both_2T.is_pinned():
            both_2T = both_2T.pin_memory()
        both_2T = both_2T.to(device, non_blocking=True)
        return Batch(both_2T[0], both_2T[1], self.seq.to(device), self.num_labels, both_2T)


def shifted_labels(ex: Example) -> list[int]:
    """Targets of each position of one sequence: next token if it is trainable, else -100."""
    ids, trainable = ex.input_ids, ex.trainable
    out = [ids[t + 1] if trainable[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    out.append(IGNORE_INDEX)
    return out


def collate(examples: Sequence[Example]) -> Batch:
    """Concatenate examples into one packed batch (see module docstring)."""
    if not examples:
        raise ValueError("collate: no examples; a batch needs at least one.")
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        if len(ex.input_ids) != len(ex.trainable):
            raise ValueError(
                f"collate: example has {len(ex.input_ids)} ids but {len(ex.trainable)} mask values."
            )
        ids.extend(ex.input_ids)
        labels.extend(shifted_labels(ex))
    num_labels = sum(1 for x in labels if x != IGNORE_INDEX)
    host_2T = torch.tensor([ids, labels], dtype=torch.int64)
    if torch.cuda.is_available():
        host_2T = host_2T.pin_memory()
    seq = SeqInfo.from_lengths([len(ex) for ex in examples])
    return Batch(host_2T[0], host_2T[1], seq, num_labels, host_2T)
