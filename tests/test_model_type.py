"""A model source's type read before anything loads (checkpoint/model_type.py): config.json,
a GGUF header's architecture (checked against gguf's own reader), one line listing the
supported types for the rest."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from slipstream.checkpoint.model_type import check_model_source, model_type_of
from slipstream.models import FAMILIES
from slipstream.sources import gguf_header_string, smollm2_gguf_path

ARCH = "general.architecture"


def write_gguf(path, arch, *, keys_first=True):
    """A GGUF with a few keys of each kind, the architecture key after them unless
    `keys_first` is False (gguf's writer puts it first)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_uint32("test.u32", 7)
    w.add_string("test.text", "hello")
    w.add_bool("test.flag", True)
    if keys_first:  # move general.architecture to the end of the header's keys
        kv = w.kv_data[0]
        kv["general.architecture"] = kv.pop("general.architecture")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("keys_first", [True, False])
def test_gguf_architecture_from_the_header_equals_ggufs_reader(tmp_path, keys_first):
    path = write_gguf(tmp_path / "m.gguf", "qwen3", keys_first=keys_first)
    reader = gguf.GGUFReader(str(path))
    assert list(reader.fields).index("general.architecture") == (9 if keys_first else 3)
    assert gguf_header_string(path, ARCH) == reader.fields[ARCH].contents()
    assert gguf_header_string(path, "test.text") == "hello"  # after the arrays, any key order
    assert model_type_of(str(path))[0] == "qwen3"
    assert model_type_of("smollm2-demo")[0] == "llama"
    assert gguf_header_string(smollm2_gguf_path(), ARCH) == "llama"
    if keys_first:  # the 7th key: not among the first 3
        assert gguf_header_string(path, ARCH, max_keys=3) is None
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00")  # cut off: the loader says so
    assert model_type_of(str(tmp_path / "junk.gguf")) is None


def test_unsupported_types_are_one_line_listing_the_supported(tmp_path):
    import transformers

    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))  # no causal LM
    with pytest.raises(ValueError) as e:
        check_model_source(str(folder))
    assert str(e.value) == (
        f"model.path: {folder / 'config.json'}: model_type 't5' is not supported: it has no "
        f"native family ({', '.join(sorted(FAMILIES))}) and transformers "
        f"{transformers.__version__} builds no causal LM of that type (AutoModelForCausalLM)."
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    check_model_source(str(folder))  # no native family: the generic one builds it
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' cannot be imported"):
        check_model_source(str(write_gguf(tmp_path / "m.gguf", "mamba")))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    check_model_source(str(folder))  # supported: nothing to say
    check_model_source("someone/not-in-the-cache")  # a hub id: only a download could tell
