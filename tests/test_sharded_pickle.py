"""FSDP2 checkpoints are read without running a pickle planted in them.

torch.distributed.checkpoint unpickles `.metadata` and the non-tensor entries of the
`.distcp` files; train/fsdp_shards.py reads the first through an allowlist unpickler and the
second with weights_only=True. Checked on one-process checkpoints (dcp.save needs no process
group): a genuine one round-trips, a payload in either place is refused naming the file and
never runs, and the allowlist refuses what calls, imports or opens.
"""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.planted import Planted

from slipstream.train import fsdp_shards
from slipstream.train.fsdp_shards import MetadataUnpickler, UnsafePickle, read_shards

# dcp.save/load without a process group say so once per call; one process is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(fill: float | None = None, lr: object = 1e-3) -> dict:
    """Shaped like save_shards' state: weights, Adam moments, param_groups (bytes entries)."""
    torch.manual_seed(0)
    w, m = torch.randn(3, 5), torch.randn(3, 5)
    if fill is not None:
        w, m = torch.full_like(w, fill), torch.full_like(m, fill)
    return {
        "model": {"layer.lora_A.weight": w},
        "optimizer": {
            "state": {"layer.lora_A.weight": {"step": torch.tensor(3.0), "exp_avg": m}},
            "param_groups": [
                {"lr": lr, "betas": (0.9, 0.95), "params": ["layer.lora_A.weight"],
                 "foreach": None, "maximize": False},
            ],
        },
    }  # fmt: skip


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "step-000003"
    dcp.save(state(), checkpoint_id=str(path))
    return path


def load_into_blank(path):
    loaded = state(fill=0.0, lr=0.0)
    loaded["optimizer"]["param_groups"][0].update(betas=None, params=None)
    read_shards(path, loaded)
    return loaded


def test_a_genuine_checkpoint_round_trips(saved):
    loaded, want = load_into_blank(saved), state()
    torch.testing.assert_close(loaded["model"], want["model"], rtol=0, atol=0)
    torch.testing.assert_close(
        loaded["optimizer"]["state"], want["optimizer"]["state"], rtol=0, atol=0
    )
    assert loaded["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]


def test_a_payload_in_the_metadata_is_refused_and_never_run(saved, tmp_path):
    file, marker = saved / ".metadata", tmp_path / "pwned"
    metadata = pickle.loads(file.read_bytes())
    metadata.planner_data["extra"] = Planted(marker)
    file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafePickle) as e:
        load_into_blank(saved)
    assert e.value.args == (str(file), "it calls pathlib.Path.touch"), e.value.args
    assert not marker.exists()
    pickle.loads(file.read_bytes())  # the plant is live: torch's own reader would run it
    assert marker.exists()


def test_a_payload_in_a_bytes_entry_is_refused_and_never_run(tmp_path):
    path, marker = tmp_path / "ckpt", tmp_path / "pwned"
    dcp.save(state(lr=Planted(marker)), checkpoint_id=str(path))
    assert not marker.exists()
    with pytest.raises(UnsafePickle) as e:
        load_into_blank(path)
    file, what = e.value.args
    assert file == str(path / "__0_0.distcp"), file
    assert what.startswith("entry optimizer.param_groups.0.lr: it calls "), what
    assert not marker.exists()


def test_the_refusal_is_one_line_naming_the_file(saved, tmp_path, monkeypatch):
    """load_checkpoint's message for a sharded checkpoint, as the CLI prints it."""
    from slipstream.train import state as train_state

    file = saved / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    metadata.planner_data["extra"] = Planted(tmp_path / "pwned")
    file.write_bytes(pickle.dumps(metadata))
    monkeypatch.setattr(train_state, "read_state", lambda path: {"world_size": 1})
    monkeypatch.setattr(train_state.dist, "is_sharded", lambda model: True)
    monkeypatch.setattr(fsdp_shards, "_sharded_state", lambda model, optimizer: state())
    with pytest.raises(train_state.CheckpointError) as e:
        train_state.load_checkpoint(saved, model=None, optimizer=None, scheduler=None)
    line = str(e.value)
    assert line.startswith(f"resume: refused {file}: ") and "\n" not in line, line
    assert "(it calls pathlib.Path.touch); it was not run" in line, line
    assert not (tmp_path / "pwned").exists()


ALLOWED = [
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "bfloat16"), ("torch", "strided"),
    ("torch", "channels_last"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("builtins", "set"),
]  # fmt: skip
REFUSED = [
    ("builtins", "exec"), ("builtins", "eval"), ("builtins", "getattr"),
    ("builtins", "__import__"), ("os", "system"), ("subprocess", "Popen"),
    ("torch", "load"), ("torch", "save"), ("torch.serialization", "load"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),  # a class, no dataclass
    ("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save"),  # writes files
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
    ("torch.distributed.checkpoint.metadata", "__builtins__"),
    ("torch.distributed.checkpoint.metadata", "torch"),  # a module it imported
    ("torch.distributed.checkpointx", "Metadata"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "name"), ALLOWED)
def test_the_allowlist_builds_checkpoint_metadata(module, name):
    assert MetadataUnpickler._allowed(module, name) is not None


@pytest.mark.parametrize(("module", "name"), REFUSED)
def test_the_allowlist_refuses_what_calls_imports_or_opens(module, name):
    assert MetadataUnpickler._allowed(module, name) is None
