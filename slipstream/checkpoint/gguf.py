"""GGUF import: HF config and HF-named tensors from a .gguf file, for every family we export.

The config comes from the metadata (`gguf_config.py`). Tensors stream one at a time from the
memory-mapped file, each dequantised with the `gguf` package (`gguf.quants.dequantize`) and
renamed by running the export backwards: the family's own checkpoint names (its `WeightMap`
over a meta model) go through `gguf_arch.to_llama_cpp`, which gives each HF tensor's
llama.cpp name(s); the family's `GGUFSpec.to_hf` undoes the layout changes (gguf_families.py:
each beside its export). So a file llama.cpp's converter wrote for these families reads the
same way as ours.

Shapes: GGUF lists dims fastest-first (ne0, ne1); numpy/torch arrays here are (ne1, ne0), the
usual (out_features, in_features).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream.checkpoint.gguf_config import hf_config_from_gguf
from slipstream.checkpoint.gguf_families import CONFIG_TENSORS
from slipstream.checkpoint.gguf_fields import field
from slipstream.checkpoint.gguf_spec import GGUFSpec
from slipstream.sources import (  # noqa: F401 (re-exported: the demo file lives here too)
    SMOLLM2_FILE,
    SMOLLM2_INSTALL,
    builtin_hub_id,
    smollm2_gguf_path,
)


def _open(path: str | Path) -> Any:
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist.")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from None


def gguf_hub_id(path: str | Path, reader: Any = None) -> str | None:
    """The hub checkpoint a GGUF file was converted from: a built-in model's, or the one its
    metadata names (`general.source.huggingface.repository`, or a huggingface.co
    `general.source.url`); else None. Reading the metadata parses the whole header (the
    vocabulary too: seconds for SmolLM2), so pass the `reader` when one is open."""
    if builtin_hub_id(path):
        return builtin_hub_id(path)
    reader = reader if reader is not None else _open(path)
    repo = field(reader, "general.source.huggingface.repository")
    if isinstance(repo, str) and repo.count("/") == 1:
        return repo
    url = field(reader, "general.source.url")
    m = re.fullmatch(r"https?://huggingface\.co/([\w.-]+/[\w.-]+)/?", url or "")
    return m.group(1) if m else None


def read_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(HF config dict, iterator of (HF name, dequantised tensor)) for a GGUF file of any
    architecture in `gguf_config.MODEL_TYPES`.

    Tensors are produced one at a time from the memory-mapped file, so peak memory is about
    one dequantised tensor (a MoE layer's pair of expert tensors) beyond what the caller keeps.
    """
    reader = _open(path)
    config = hf_config_from_gguf(reader, path)
    hub_id = gguf_hub_id(path, reader)
    if hub_id:  # transformers' key for where a config came from
        config["_name_or_path"] = hub_id
    return config, _tensors(reader, config, dtype, path)


def _tensors(
    reader: Any, config: dict, dtype: torch.dtype, path: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    sources, cfg, spec = _sources(config)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        if t.name not in sources:
            raise ValueError(
                f"{path}: GGUF tensor {t.name!r} has no {config['model_type']} equivalent; "
                "unsupported file."
            )
        hf, parts = sources[t.name]
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        # A copy: F32 tensors are read-only views of the memory-mapped file.
        got = pending.setdefault(hf, {})
        got[t.name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
        if len(got) == len(parts):
            del pending[hf]
            for name, x in spec.to_hf(cfg, hf, [got[p] for p in parts]):
                yield name, x.to(dtype)
    if pending:
        hf, got = next(iter(pending.items()))
        missing = [p for p in sources if sources[p][0] == hf and p not in got]
        raise ValueError(f"{path}: GGUF tensor {missing[0]!r} is missing (for {hf!r}).")


def _sources(config: dict) -> tuple[dict[str, tuple[str, tuple[str, ...]]], Any, GGUFSpec]:
    """{llama.cpp name: (HF name, the llama.cpp names it is made of)}: the export's names
    (`gguf_arch`) run backwards over the family's own checkpoint names, from a meta model."""
    import gguf

    from slipstream.checkpoint.gguf_arch import gguf_arch, to_llama_cpp
    from slipstream.checkpoint.gguf_families import BY_MODEL_TYPE
    from slipstream.models import family_for, weight_map
    from slipstream.models.qwen3_moe import PER_EXPERT

    family = family_for(config["model_type"], "GGUF metadata")
    cfg = family.config_from_hf({k: v for k, v in config.items() if k != "_name_or_path"})
    spec = BY_MODEL_TYPE[cfg.model_type]
    table = gguf.get_tensor_name_map(gguf_arch(cfg.model_type), cfg.num_hidden_layers)

    def rename(hf_name: str) -> str:
        out = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert out is not None, f"no llama.cpp name for {hf_name} ({spec.arch})"  # export refuses
        return out

    with torch.device("meta"):
        model = family.build(cfg)
    sources: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, t in weight_map(cfg).hf_state(model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = PER_EXPERT.match(name)
        if m is not None:  # qwen3_moe: one (E, F, D) tensor per projection, unstacked on read
            name = f"{m.group(1)}.{m.group(3)}.weight"
        parts = tuple(g for g, _ in to_llama_cpp(spec, cfg, name, t, rename))
        for g in parts:
            sources[g] = (name, parts)
    return sources, cfg, spec


def gguf_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer (with the chat template) stored in a GGUF file."""
    import transformers

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist.")
    folder, name = str(path.parent), path.name
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception:
        # AutoTokenizer parses the model config to pick a class, and transformers' parser
        # crashes on gpt-oss's RoPE keys (numpy 2); gpt-oss's class is the generic one.
        if field(_open(path), "general.architecture") != "gpt-oss":
            raise
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
