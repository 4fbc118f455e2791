"""The packed-batch builder (data/packed.py): scored spans -> labels and positions, and named
fields beside them that ride one host buffer through `.to()`."""

import pytest
import torch

from slipstream.data.packed import IGNORE_INDEX, PackedBuilder, PerSpan, target_spans
from slipstream.objectives.grpo_data import RolloutBatch
from slipstream.ops.packing import SeqInfo

X = IGNORE_INDEX


class HostToDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """The host tensors copied to another device inside the block (their element counts)."""

    def __init__(self):
        super().__init__()
        self.copied = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.ops.aten._to_copy.default and src is not None and src.device != out.device:
            self.copied.append(src.numel())
        return out


def extra_batch():
    """Two sequences with a per-token bool, a per-scored int, a per-sequence float field and
    a whole (K, D) float tensor (image features, say)."""
    b = PackedBuilder(image=("token", torch.bool), slot=("scored", torch.int64),
                      shard=("sequence", torch.float32))  # fmt: skip
    b.add([5, 6, 7, 8], [(0, 2), (2, 4)], image=[False, True, True, False],
          slot=PerSpan((7, 9)), shard=0.5)  # fmt: skip
    b.add([9, 10, 11], [(0, 3)], image=False, slot=[1, 2], shard=[2.0])
    b.put("features", torch.arange(6, dtype=torch.float32).view(3, 2) / 4)
    return b.build()


def test_spans_make_labels_positions_and_fields():
    batch = extra_batch()
    # Position t scores token t + 1; token 0 of a sequence is never scored.
    assert batch.labels.tolist() == [6, 7, 8, X, 10, 11, X]
    assert batch.label_positions.tolist() == [0, 1, 2, 4, 5] and batch.num_labels == 5
    assert batch.fields["slot"].tolist() == [7, 9, 9, 1, 2]  # one value a span's tokens
    assert batch.fields["image"].tolist() == [False, True, True, False, False, False, False]
    assert batch.fields["shard"].tolist() == [0.5, 2.0] and batch.seq.lengths == (4, 3)
    assert target_spans([False, True, True, False, True]) == [(1, 3), (4, 5)]
    assert target_spans([True, False]) == [(0, 1)] and target_spans([False]) == []


def test_extra_fields_ride_through_to_in_one_copy():
    batch = extra_batch()
    want = {k: v.clone() for k, v in batch.fields.items()}
    # Every tensor is a view of the one host buffer.
    lo, hi = batch._host.data_ptr(), batch._host.data_ptr() + batch._host.nbytes
    for t in [batch.input_ids, batch.labels, batch.label_positions, *batch.fields.values()]:
        assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi
    moved = batch.to("cpu")
    assert moved.fields.keys() == want.keys()
    for name, value in want.items():
        assert moved.fields[name].dtype == value.dtype and torch.equal(moved.fields[name], value)
    assert moved.fields["features"].shape == (3, 2)
    # Another device: the buffer is copied once, the SeqInfo's buffer once, nothing else.
    with HostToDevice() as copies:
        on_meta = batch.to("meta")
    assert copies.copied == [batch._host.numel(), batch.seq._host.numel()]
    assert {k: (v.device.type, v.dtype, v.shape) for k, v in on_meta.fields.items()} == {
        k: ("meta", v.dtype, v.shape) for k, v in want.items()
    }
    # An objective's view carries the extras too, with no collator of its own.
    view = RolloutBatch(batch, 2, 5, 5, 1.0).to("cpu")
    assert torch.equal(view.packed.fields["shard"], want["shard"]) and view.positions.numel() == 5


def test_a_seqinfo_field_keeps_its_host_lengths_and_moves_by_its_own_copy():
    """A SeqInfo beside the tensors (a vision tower's images, data/qwen_vit_meta.py): not in
    the buffer; `.to()` moves it with one copy of its own, built or hand-made batch alike."""
    b = PackedBuilder()
    b.add([5, 6, 7], [(1, 3)])
    b.put("features", torch.ones(2, 2))
    b.put("patches", SeqInfo.from_lengths([4, 6]))
    batch = b.build()
    assert [s.name for s in batch._layout] == ["input_ids", "labels", "label_positions", "features"]
    with HostToDevice() as copies:
        on_meta = batch.to("meta")
    patches = batch.fields["patches"]
    assert sorted(copies.copied) == sorted([batch._host.numel(), batch.seq._host.numel(),
                                           patches._host.numel()])  # fmt: skip
    moved = on_meta.fields["patches"]
    assert isinstance(moved, SeqInfo) and moved.lengths == (4, 6)
    assert moved.cu_seqlens.device.type == "meta" and on_meta.fields["features"].is_meta
    batch._host = None  # changed by hand: packed again when moved, the SeqInfo kept apart
    assert batch.to("meta").fields["patches"].lengths == (4, 6)


def test_builder_names_a_field_given_wrongly():
    b = PackedBuilder(slot=("scored", torch.int64))
    with pytest.raises(ValueError, match="field 'slot' has 3 values, needs 2"):
        b.add([1, 2, 3], [(1, 3)], slot=[1, 2, 3])
    with pytest.raises(ValueError, match=r"fields \[\]; this batch has \['slot'\]"):
        b.add([1, 2, 3], [(1, 3)])
    with pytest.raises(ValueError, match="PerSpan is one value a span, scored"):
        b.add([1, 2, 3], [(1, 3)], slot=PerSpan((1, 2)))
    with pytest.raises(ValueError, match="kind 'pixel'"):
        PackedBuilder(x=("pixel", torch.float32))
