"""A PEFT LoRA adapter as a GGUF LoRA: llama.cpp's `--lora FILE`, Ollama's `ADAPTER`.

The file holds, per adapted matrix, `<llama.cpp name>.lora_a` (r, in) and `.lora_b` (out, r),
float32, with `adapter.lora.alpha`; llama.cpp adds (alpha / r) * B @ A to the base weight, as
PEFT does. Only the adapter is read (plus the base's config for the architecture and head
counts), never the base weights. rsLoRA's scale alpha / sqrt(r) is written as the alpha that
gives it; per-target ranks and alphas (rank_pattern / alpha_pattern) are folded into each B;
layouts follow the base export (llama's Q/K row permutation applies to B's rows).
DoRA and LoRA on MoE experts have no GGUF LoRA form: one-line errors.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from slipstream.checkpoint.atomic import atomic_write
from slipstream.checkpoint.gguf_arch import gguf_arch
from slipstream.checkpoint.gguf_families import BY_MODEL_TYPE
from slipstream.checkpoint.gguf_spec import IMAGE_TEXT_LM
from slipstream.peft.names import PEFT_PREFIX


def export_adapter_gguf(
    adapter_dir: str | os.PathLike, out: str | os.PathLike | None = None, base: str | None = None,
    force: bool = False, default: Path | None = None,
) -> Path:  # fmt: skip
    """Write `adapter_dir`'s LoRA as a GGUF LoRA file (by default `adapter_dir/gguf/adapter.gguf`,
    or `default`); returns its path. An existing file is replaced only with `force`."""
    import torch
    from safetensors.torch import load_file

    src = Path(adapter_dir)
    cfg_path = src / "adapter_config.json"
    if not cfg_path.is_file():
        from slipstream.sources import unfinished_run

        said = unfinished_run(src, "export") if src.is_dir() else None
        raise ValueError(
            said or f"no adapter_config.json in {str(src)!r} (is it an adapter folder?)"
        )
    acfg = json.loads(cfg_path.read_text())
    if acfg.get("use_dora"):
        raise ValueError(
            "GGUF LoRA: a DoRA adapter has no llama.cpp form; export it merged (--gguf)."
        )
    from slipstream.sources import adapter_base, resolve_model

    # The local source while it exists, else the recorded base; a built-in name: its file.
    base = resolve_model(base or adapter_base(src), "--base")
    cfg = _base_config(base)
    if cfg.model_type in IMAGE_TEXT_LM:  # its language model's names are not written here
        raise ValueError(
            f"GGUF LoRA: a {cfg.model_type} adapter has no GGUF LoRA form here; export it "
            "merged (--gguf), which writes the text model and its mmproj."
        )
    arch = gguf_arch(cfg.model_type)
    from slipstream.checkpoint.gguf_export import GGUF_DIR, _check_writable, gguf_output

    default = default or src / GGUF_DIR / "adapter.gguf"
    path = gguf_output(out, default, force, modelfile=False)
    _check_writable(path)
    from slipstream.peft.matching import check_keys

    check_keys(acfg, cfg_path)
    rank = int(acfg["r"])
    alpha = float(acfg.get("lora_alpha", rank))
    if acfg.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # llama.cpp scales by alpha / r
    weights = load_file(str(src / "adapter_model.safetensors"))
    _fold_scales(weights, acfg, alpha)
    pairs = _pairs(weights, cfg, arch)

    def write(tmp: str) -> None:
        import gguf

        w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", alpha)
        for name, (a, b) in pairs.items():
            w.add_tensor(f"{name}.lora_a", a.to(torch.float32).numpy())
            w.add_tensor(f"{name}.lora_b", b.to(torch.float32).numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(path, write)


def _base_config(base: str) -> Any:
    """The base's ModelConfig from config.json or GGUF metadata (no weights read)."""
    from slipstream.models import family_for

    if str(base).endswith(".gguf"):
        from slipstream.checkpoint.gguf import read_gguf

        hf, _ = read_gguf(base)  # the tensor iterator is lazy: never started
    else:
        from slipstream.checkpoint.hf import _resolve_folder, read_config

        hf = read_config(_resolve_folder(Path(base)))
    return family_for(hf.get("model_type")).config_from_hf(hf)


def _fold_scales(weights: dict, acfg: dict, alpha: float) -> None:
    """llama.cpp scales every matrix by one alpha over its own rank; peft by each target's
    rank_pattern / alpha_pattern (and rsLoRA's sqrt): the ratio goes into that target's B."""
    from slipstream.peft.matching import rank_alpha

    for key, t in weights.items():
        if ".lora_B." not in key:
            continue
        r, a = rank_alpha(acfg, key.removeprefix(PEFT_PREFIX).split(".lora_")[0])
        scale = a / math.sqrt(r) if acfg.get("use_rslora") else a / r
        factor = scale * t.shape[1] / alpha
        if not math.isclose(factor, 1.0, rel_tol=1e-12):
            weights[key] = t * factor


def _pairs(weights: dict, cfg: Any, arch: Any) -> dict[str, tuple[Any, Any]]:
    import gguf

    from slipstream.models import weight_map
    from slipstream.models.weights import from_hf_name

    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    layouts = weight_map(cfg).layouts
    spec = BY_MODEL_TYPE[cfg.model_type]
    pairs: dict[str, list] = {}
    for key, t in weights.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            raise ValueError(f"GGUF LoRA: adapter tensor {key!r} is not a LoRA A/B matrix.")
        module = key.removeprefix(PEFT_PREFIX).split(".lora_")[0]
        if layouts:
            module = from_hf_name(module, layouts) or module
        if ".experts" in module:
            raise ValueError(
                "GGUF LoRA: LoRA on MoE experts has no llama.cpp form; export it merged (--gguf)."
            )
        if module.endswith(spec.no_lora):
            raise ValueError(
                f"GGUF LoRA: llama.cpp's {spec.name} applies no LoRA to {module!r}; export it "
                "merged (--gguf), or train without that target."
            )
        gname = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if gname is None:
            raise ValueError(f"GGUF LoRA: no llama.cpp name for adapted module {module!r}.")
        slot = pairs.setdefault(gname, [None, None])
        # B's rows are the weight's output rows, A's columns its input columns: the export's
        # row (column) permutation applies to them.
        slot[0 if ".lora_A." in key else 1] = (
            spec.lora_a(cfg, module, t) if ".lora_A." in key else spec.lora_b(cfg, module, t)
        )
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"GGUF LoRA: {name} has only one of lora_A/lora_B.")
    return {k: (a, b) for k, (a, b) in pairs.items()}


__all__ = ["export_adapter_gguf"]
