"""GGUF import: HF config and HF-named tensors from a .gguf file, for every family we train.

llama-architecture files (Llama, SmolLM2, Mistral) are read here, streaming one tensor at a
time. The others (qwen2, qwen3, qwen3moe, phi3, gemma3) go through transformers' GGUF reader,
which dequantises and renames them to its own module tree (the whole model in memory); we fill
in the hyperparameters its key table leaves out (`_fill_config`).

Each tensor is dequantised with the `gguf` package (`gguf.quants.dequantize`) and renamed
from llama.cpp's names (`blk.N.attn_q.weight`) to Hugging Face Llama names
(`model.layers.N.self_attn.q_proj.weight`). llama.cpp's converter permutes the rows of Q and
K so each head's rotary pairs are interleaved (GPT-J style, (x0, x1), (x2, x3), ...) instead of
split in halves (HF's rotate_half); we undo that permutation so the weights fit HF's RoPE.

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

from slipstream.sources import (  # noqa: F401 (re-exported: the demo file lives here too)
    SMOLLM2_FILE,
    SMOLLM2_INSTALL,
    builtin_hub_id,
    smollm2_gguf_path,
)

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama parameter name for a llama.cpp tensor name."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in _PER_LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama equivalent; unsupported file.")
    return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> two halves."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _open(path: str | Path) -> Any:
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist.")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from None


def hf_config_from_gguf(reader: Any) -> dict:
    """A Hugging Face LlamaConfig-style dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; only 'llama' (e.g. SmolLM2)."
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF with llama3 rope scaling (rope_freqs) is not supported yet.")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    vocab = _field(reader, p + "vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling and scaling != "none":
        factor = float(_field(reader, p + "rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": scaling, "factor": factor}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key.replace('pad_', 'padding_')}")
        if value is not None:
            config[key] = int(value)
    return config


def gguf_hub_id(path: str | Path, reader: Any = None) -> str | None:
    """The hub checkpoint a GGUF file was converted from: a built-in model's, or the one its
    metadata names (`general.source.huggingface.repository`, or a huggingface.co
    `general.source.url`); else None. Reading the metadata parses the whole header (the
    vocabulary too: seconds for SmolLM2), so pass the `reader` when one is open."""
    if builtin_hub_id(path):
        return builtin_hub_id(path)
    reader = reader if reader is not None else _open(path)
    repo = _field(reader, "general.source.huggingface.repository")
    if isinstance(repo, str) and repo.count("/") == 1:
        return repo
    url = _field(reader, "general.source.url")
    m = re.fullmatch(r"https?://huggingface\.co/([\w.-]+/[\w.-]+)/?", url or "")
    return m.group(1) if m else None


def _tensors(reader: Any, config: dict, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if part in heads:
            w = unpermute_rotary(w, heads[part])
        # A copy: F32 tensors are read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).to(dtype)


def read_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(HF config dict, iterator of (HF name, dequantised tensor)) for a llama GGUF file.

    Tensors are produced one at a time from the memory-mapped file, so peak memory is about
    one dequantised tensor beyond what the caller keeps.
    """
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        return _read_with_transformers(path, reader, arch, dtype)
    config = hf_config_from_gguf(reader)
    hub_id = gguf_hub_id(path, reader)
    if hub_id:  # transformers' key for where a config came from
        config["_name_or_path"] = hub_id
    return config, _tensors(reader, config, dtype)


# transformers' GGUF reader for these llama.cpp architectures -> our families.
TRANSFORMERS_ARCHS = ("qwen2", "qwen3", "qwen3moe", "phi3", "gemma3")


def _read_with_transformers(
    path: str | Path, reader: Any, arch: str, dtype: torch.dtype
) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    if arch not in TRANSFORMERS_ARCHS:
        why = (
            " (transformers' GGUF reader cannot parse gpt-oss's RoPE metadata; load the HF "
            "checkpoint instead)"
            if arch == "gpt-oss"
            else ""
        )
        supported = ", ".join(("llama", *TRANSFORMERS_ARCHS))
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} cannot be imported{why}; supported: {supported}."
        )
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    _fill_config(config, reader, arch)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype
    )
    hf = {**hf_config.to_dict(), "model_type": hf_config.model_type}
    return hf, iter(parsed["tensors"].items())


def _fill_config(config: dict, reader: Any, arch: str) -> None:
    """Hyperparameters transformers' key table misses (it would take its defaults: head_dim
    128 for qwen3, moe_intermediate_size 768, Gemma 3's query scale 256)."""
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = int(key_length)
    expert_width = _field(reader, f"{arch}.expert_feed_forward_length")
    if arch == "qwen3moe" and expert_width is not None:
        config["moe_intermediate_size"] = int(expert_width)
    if arch == "gemma3":
        # llama.cpp scales queries by 1/sqrt(head_dim) (the 62-layer 27B by 1/sqrt(D/H)).
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        heads = config["num_attention_heads"]
        scalar = hidden // heads if layers == 62 else config.get("head_dim", 256)
        config["query_pre_attn_scalar"] = scalar
        local = _field(reader, f"{arch}.rope.freq_base_swa")
        if local is not None:
            config["rope_local_base_freq"] = float(local)
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if factor is not None and float(factor) != 1.0:
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}


def gguf_tokenizer(path: str | Path) -> Any:
    """The transformers tokenizer (with the chat template) stored in a GGUF file."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist.")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
