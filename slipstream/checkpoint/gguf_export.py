"""GGUF export: the merged model as one llama.cpp/Ollama file, written from Python.

`export_gguf(model, path, type=...)` folds LoRA into the weights (as `export_merged` does),
then streams the tensors into a GGUF: two passes over the model, the first for the tensor
table (names, shapes, types), the second converting and writing one tensor at a time, so
peak memory is the model plus one converted tensor, never a second copy of the model.

Types: `f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1` are quantised by the
`gguf` package (numpy). The K-quants (`q4_k_m`, `q5_k_m`, `q6_k`, ...) go through llama.cpp's
own quantizer (`llama_model_quantize` from `llama-cpp-python`, the `slipstream[gguf]` extra):
we write an exact intermediate GGUF (f32 for a float32 model, bf16 otherwise) beside the
target and let llama.cpp rewrite it. As llama.cpp's converter does, 1-D tensors (norms,
biases, sinks), MoE routers and convolution kernels stay f32, and a tensor whose rows do not
fill whole quant blocks falls back to f16.

The tokenizer goes in under `tokenizer.ggml.*` with its special tokens and chat template:
copied verbatim from the source GGUF when the model was loaded from one, otherwise built from
the Hugging Face tokenizer. Every file is written to a temp name and renamed when complete.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream.checkpoint.atomic import atomic_write, atomic_write_text
from slipstream.checkpoint.gguf_arch import (
    ARCHS,
    PRE_TOKENIZER,
    check_supported,
    gguf_arch,
    gguf_tensors,
    write_metadata,
)
from slipstream.checkpoint.gguf_mmproj import (
    adapter_trains_vision,
    export_mmproj,
    image_processor_config,
    is_image_text,
    mmproj_refusal,
    mmproj_type,
)

PURE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# llama.cpp's quantizer: our name -> gguf.LlamaFileType member (llama_ftype has the same values).
K_TYPES = {
    "q2_k": "MOSTLY_Q2_K",
    "q3_k_m": "MOSTLY_Q3_K_M",
    "q4_k_s": "MOSTLY_Q4_K_S",
    "q4_k_m": "MOSTLY_Q4_K_M",
    "q5_k_s": "MOSTLY_Q5_K_S",
    "q5_k_m": "MOSTLY_Q5_K_M",
    "q6_k": "MOSTLY_Q6_K",
}
GGUF_TYPES = (*PURE_TYPES, *K_TYPES)
# Where `slipstream export RUN --gguf` writes by default: not beside adapter_config.json, where
# transformers' from_pretrained(RUN, gguf_file=...) would follow the adapter to its base.
GGUF_DIR = "gguf"
# A quantisation type at the end of a file name ("SmolLM2-135M-Instruct.Q4_1"): not the model's.
QUANT_SUFFIX = re.compile(r"[.\-_](f32|f16|bf16|q\d(_[a-z0-9]+)*|iq\d\w*)$", re.IGNORECASE)
INSTALL_EXTRA = "pip install 'slipstream[gguf]' (it compiles llama.cpp; see README)"
_FILE_TYPE = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0",
              "q5_1": "MOSTLY_Q5_1"}  # fmt: skip


def check_type(type: str) -> str:
    """The type, lower-cased, or a one-line error listing the known ones."""
    t = type.lower()
    if t not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {type!r}; one of: {', '.join(GGUF_TYPES)}.")
    return t


def llama_cpp_quantizer() -> Any:
    """llama-cpp-python's low-level module, or a one-line error naming the install command."""
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(
            f"K-quant GGUF types need llama.cpp's quantizer (llama-cpp-python); run: "
            f"{INSTALL_EXTRA}, or pick a pure-Python type: {', '.join(PURE_TYPES)}."
        ) from None
    return llama_cpp


def export_gguf(
    model: Any, path: str | os.PathLike, type: str = "q8_0", tokenizer: Any = None
) -> Path:
    """Merge LoRA (if any) into `model` in place and write it to `path` as one GGUF file.

    `tokenizer`: a transformers tokenizer or its folder; None takes the one in the source
    GGUF (a model loaded from .gguf). Returns the path written.
    """
    t = check_type(type)
    arch = gguf_arch(model.config.model_type)  # unsupported family: one line, before any work
    check_supported(model.config)
    path = Path(path)
    _check_writable(path)
    if t in K_TYPES:
        llama_cpp_quantizer()  # fail before the long part
    _merge(model)
    if t not in K_TYPES:
        atomic_write(path, lambda tmp: _write(model, tmp, t, arch, tokenizer))
        return path
    exact = "f32" if next(model.parameters()).dtype == torch.float32 else "bf16"
    fd, mid = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{exact}.tmp")
    os.close(fd)
    try:
        _write(model, mid, exact, arch, tokenizer)
        atomic_write(path, lambda tmp: quantize_with_llama_cpp(mid, tmp, t))
    finally:
        Path(mid).unlink(missing_ok=True)
    return path


def quantize_with_llama_cpp(src: str | os.PathLike, dst: str | os.PathLike, type: str) -> None:
    """Rewrite GGUF `src` as `dst` in a K-quant type with llama.cpp's own quantizer."""
    import gguf

    llama_cpp = llama_cpp_quantizer()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[K_TYPES[type]])
    params.nthread = max(1, (os.cpu_count() or 1))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ValueError(
            f"llama.cpp could not quantize {src} to {type} (llama_model_quantize: {rc})."
        )


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"GGUF output {str(path)!r} is a folder; give a file name (model.gguf).")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write {str(path)!r}: folder {str(parent)!r} does not exist.")
    try:  # a real probe: permission bits say nothing for root or read-only mounts
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ValueError(
            f"cannot write {str(path)!r}: folder {str(parent)!r} is not writable ({why})."
        ) from None


def _merge(model: Any) -> None:
    from slipstream.peft.lora import lora_modules, merge_lora
    from slipstream.peft.lora_experts import expert_lora_modules
    from slipstream.peft.qlora import dequantize_model, has_4bit_weights

    if has_4bit_weights(model):
        dequantize_model(model)
    if [*lora_modules(model), *expert_lora_modules(model)]:
        merge_lora(model)


# Kept f32 in every file type, as llama.cpp's converter does: MoE routers, and convolution
# kernels (ggml's ssm_conv asserts an f32 kernel: an f16 or bf16 one aborts llama.cpp).
ALWAYS_F32 = ("ffn_gate_inp.weight", "ssm_conv1d.weight", "shortconv.conv.weight")


def tensor_type(name: str, shape: tuple[int, ...], type: str) -> Any:
    """The GGML type one tensor is stored in for a requested file type."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if len(shape) == 1 or name.endswith(ALWAYS_F32) or type == "f32":
        return Q.F32
    qtype = Q[type.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return qtype if shape[-1] % block == 0 else Q.F16


def _convert(t: torch.Tensor, qtype: Any) -> np.ndarray:
    import gguf

    x = t.detach().to("cpu", torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return x
    if qtype == gguf.GGMLQuantizationType.F16:
        return x.astype(np.float16)
    return gguf.quants.quantize(x, qtype)


def _write(model: Any, out: str, type: str, arch: Any, tokenizer: Any) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(model_name(model))
    write_metadata(w, cfg, arch)
    w.add_file_type(int(gguf.LlamaFileType[_FILE_TYPE[type]]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_tokenizer(w, model, tokenizer, arch)
    # Pass 1: the tensor table (llama.cpp reads it before the data).
    for name, t in gguf_tensors(model):
        shape = tuple(t.shape)
        qtype = tensor_type(name, shape, type)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Pass 2: the data, one tensor converted at a time.
    with torch.no_grad():
        for name, t in gguf_tensors(model):
            w.write_tensor_data(_convert(t, tensor_type(name, tuple(t.shape), type)))
    w.close()


def model_name(model: Any) -> str:
    """`general.name`: the hub id's or file's name, without `.gguf` or a quantisation suffix
    (the type of this file is `general.file_type`, not the source's)."""
    for src in (getattr(model, "name_or_path", None), getattr(model, "checkpoint_path", None)):
        name = Path(str(src or "")).name.removesuffix(".gguf")
        while QUANT_SUFFIX.search(name):
            name = QUANT_SUFFIX.sub("", name)
        if name:
            return name
    return "slipstream-export"


# ---- tokenizer -------------------------------------------------------------------------------


def write_tokenizer(w: Any, model: Any, tokenizer: Any, arch: Any) -> None:
    """tokenizer.ggml.* keys: from the source GGUF when there is one, else the HF tokenizer."""
    src = getattr(model, "checkpoint_path", None)
    if src is not None and str(src).endswith(".gguf"):
        # llama.cpp's own tokenizer fields, exact; the run's chat template if it set one.
        template = getattr(tokenizer, "chat_template", None)
        copy_tokenizer_fields(w, src, skip=("tokenizer.chat_template",) if template else ())
        if template:
            w.add_chat_template(template)
        return
    if tokenizer is None:
        raise ValueError(
            "GGUF export needs the tokenizer (llama.cpp and Ollama read it from the file): "
            "pass tokenizer= (a transformers tokenizer or its folder)."
        )
    with tempfile.TemporaryDirectory(prefix="slipstream-tok-") as tmp:
        folder = Path(tokenizer) if isinstance(tokenizer, str | os.PathLike) else None
        if folder is None:
            tokenizer.save_pretrained(tmp)
            folder = Path(tmp)
        _write_hf_tokenizer(w, folder, model.config.vocab_size, arch)


def copy_tokenizer_fields(w: Any, gguf_path: str | os.PathLike, skip: tuple = ()) -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key in skip:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def _write_hf_tokenizer(w: Any, folder: Path, vocab_size: int, arch: Any) -> None:
    import gguf

    tok_json = folder / "tokenizer.json"
    if not tok_json.is_file():
        raise ValueError(f"GGUF export: the tokenizer in {folder} has no tokenizer.json (fast).")
    data = json.loads(tok_json.read_text(encoding="utf-8"))
    model = data.get("model", {})
    byte_level = model.get("type") == "BPE" and not model.get("byte_fallback", False)
    if byte_level:
        tokens, types = _bpe_tokens(data)
        scores = None
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(PRE_TOKENIZER.get(arch.name, "default"))
    else:  # sentencepiece-style (Llama 2, Mistral, Phi-3, Gemma 3)
        vocab = (
            gguf.vocab.SentencePieceVocab(folder)
            if (folder / "tokenizer.model").is_file()
            else gguf.vocab.LlamaHfVocab(folder)
        )
        entries = list(vocab.all_tokens())
        tokens = [e[0].decode("utf-8", errors="replace") for e in entries]
        scores = [float(e[1]) for e in entries]
        types = [int(e[2]) for e in entries]
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
    if len(tokens) > vocab_size:
        raise ValueError(
            f"GGUF export: the tokenizer has {len(tokens)} tokens but the model's vocab_size is "
            f"{vocab_size}; export with the tokenizer the model was trained with."
        )
    for i in range(len(tokens), vocab_size):  # padded embedding rows (e.g. Qwen's)
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    special = gguf.SpecialVocab(folder, load_merges=byte_level, n_vocab=vocab_size)
    special.add_to_gguf(w, quiet=True)
    if "bos" not in special.add_special_token:  # said, so llama.cpp and Ollama need not guess
        w.add_add_bos_token(_adds_bos(tok_json, special.special_token_ids.get("bos")))
    if special.chat_template is None:
        template = _chat_template(folder)
        if template:
            w.add_chat_template(template)


def _bpe_tokens(data: dict) -> tuple[list[str], list[int]]:
    """Byte-level BPE: the token strings by id; special added tokens CONTROL, other added
    tokens USER_DEFINED (llama.cpp matches both as whole pieces)."""
    import gguf

    by_id = {i: s for s, i in data["model"]["vocab"].items()}
    kinds = {}
    for a in data.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
        kinds[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    n = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [int(kinds.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED))
             for i in range(n)]  # fmt: skip
    return tokens, types


def _adds_bos(tok_json: Path, bos_id: int | None) -> bool:
    """Does the HF tokenizer put BOS in front when it encodes text (its post-processor)?"""
    from tokenizers import Tokenizer

    return bos_id is not None and Tokenizer.from_file(str(tok_json)).encode("a").ids[:1] == [bos_id]


def _chat_template(folder: Path) -> str | None:
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def modelfile_path(gguf_path: str | os.PathLike) -> Path:
    """The Modelfile of a GGUF is named after it (m.q8_0.gguf -> m.q8_0.Modelfile), so two
    exports into one folder keep one each."""
    return Path(gguf_path).with_suffix(".Modelfile")


def mmproj_path(text_gguf: str | os.PathLike, type: str) -> Path:
    """An image-text model's mmproj beside its text file, in its own type (`mmproj_type`):
    m.q8_0.gguf -> mmproj-m.f16.gguf."""
    text_gguf = Path(text_gguf)
    stem = QUANT_SUFFIX.sub("", text_gguf.stem)
    return text_gguf.with_name(f"mmproj-{stem}.{mmproj_type(type)}.gguf")


def write_modelfile(gguf_path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """An Ollama Modelfile beside the GGUF: FROM, TEMPLATE (from the chat template), stops."""
    from slipstream.checkpoint.gguf_modelfile import modelfile_text

    gguf_path = Path(gguf_path)
    out = Path(out) if out is not None else modelfile_path(gguf_path)
    return atomic_write_text(out, modelfile_text(gguf_path))


def gguf_output(
    out: str | os.PathLike | None, default: Path, force: bool, modelfile: bool = True
) -> Path:  # fmt: skip
    """Where an export writes its .gguf: `out` (a folder: `default`'s name inside it), else
    `default` (its folder made). A file already there (or its Modelfile) is replaced only
    with `force`."""
    path = Path(out) if out is not None else default
    if out is not None and path.is_dir():
        path = path / default.name
    if out is None:
        path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, modelfile_path(path)) if modelfile else (path,):
        if p.exists() and not force:
            raise ValueError(f"export: '{p}' exists; pass --force to replace it, or give --out")
    return path


__all__ = ["ARCHS", "GGUF_TYPES", "K_TYPES", "PURE_TYPES", "export_gguf", "write_modelfile"]


def export_run_gguf(
    source: str | os.PathLike, type: str, out: str | os.PathLike | None = None,
    base: str | None = None, force: bool = False, default: Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:  # fmt: skip
    """`slipstream export SRC --gguf TYPE`: a LoRA run/adapter folder (merged into its base) or
    a full-model folder, as one GGUF plus its Ollama Modelfile; by default in `SRC/gguf/`
    (`default`: another default path, e.g. for a checkpoint's temporary folder). An
    image-text checkpoint also gets its mmproj beside it (gguf_mmproj.py), `say` told where;
    a type without one is refused in one line before anything is written."""
    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.checkpoint.hf import load_model
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.sources import unfinished_run

    t = check_type(type)
    src = Path(source)
    adapter = (src / "adapter_config.json").is_file()
    if not adapter and not (src / "config.json").is_file():
        said = unfinished_run(src, "export")
        raise ValueError(
            said or f"{src}: neither an adapter (adapter_config.json) nor a model folder."
        )
    if adapter:
        base = base or _adapter_base(src)
    model_source = base if adapter else str(src)
    hf = _config(model_source)
    if hf is not None and is_image_text(hf) and mmproj_refusal(hf):
        raise ValueError(f"GGUF export: {mmproj_refusal(hf)}")  # nothing written
    kind = _model_type(model_source)
    if kind is not None:
        gguf_arch(kind)  # an unsupported family fails before loading
    default = default or src / GGUF_DIR / f"{src.resolve().name}.{t}.gguf"
    path = gguf_output(out, default, force)
    _check_writable(path)
    mmproj = _mmproj_target(hf, src, adapter, model_source, path, t, force)
    if t in K_TYPES:
        llama_cpp_quantizer()
    has_tokenizer = any(src.glob("tokenizer*"))
    tokenizer = load_tokenizer(str(src) if has_tokenizer else model_source)
    model = load_model(model_source)
    if hf is None:  # a hub id: its config.json is known now
        hf = _config(getattr(model, "source", "") or "")
        mmproj = _mmproj_target(hf, src, adapter, model.source, path, t, force)
    if adapter:
        load_adapter(model, src)
    export_gguf(model, path, t, tokenizer=tokenizer)
    write_modelfile(path)
    if mmproj is not None:
        export_mmproj(model.source, mmproj, t, processor_folders=(src,))
        if say is not None:
            size = mmproj.stat().st_size / 2**20
            say(f"{mmproj_type(t)} mmproj written to {mmproj} ({size:.1f} MiB); llama.cpp: "
                f"llama-mtmd-cli -m {path} --mmproj {mmproj}")  # fmt: skip
            if (hf or {}).get("audio_config"):
                say("the mmproj holds the vision side only: the audio tower is not written")
    return path


def _mmproj_target(
    hf: dict | None, src: Path, adapter: bool, model: str, text: Path, type: str, force: bool
) -> Path | None:  # fmt: skip
    """Where an image-text checkpoint's mmproj goes (None: a text model), after the checks
    that need no weights: the type's (one line), the adapter's (one that trains the vision
    side is refused: the base's tower is not the trained one) and the image processor's."""
    if hf is None or not is_image_text(hf):
        return None
    refusal = mmproj_refusal(hf)
    if refusal is not None:
        raise ValueError(f"GGUF export: {refusal}")
    if adapter and adapter_trains_vision(src):
        raise ValueError(
            f"GGUF export: the adapter in {src} trains the vision tower or projector, which "
            "the mmproj export reads from the base checkpoint; export the merged model first "
            f"(slipstream export {src} --out DIR), then DIR with --gguf."
        )
    image_processor_config((src, Path(model)))  # its mean and std: said before the long part
    path = mmproj_path(text, type)
    if path.exists() and not force:
        raise ValueError(f"export: '{path}' exists; pass --force to replace it, or give --out")
    return path


def _config(source: str) -> dict | None:
    """A local checkpoint's config.json; None for a GGUF file or a hub id."""
    cfg = Path(source) / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else None


def _adapter_base(adapter: Path) -> str:
    from slipstream.sources import adapter_base

    return adapter_base(adapter)  # the local source while it exists, else the recorded base


def _model_type(source: str) -> str | None:
    """config.json's model_type; None for a GGUF or hub id (export_gguf checks after load)."""
    hf = _config(source)
    return hf.get("model_type", "") if hf is not None else None
