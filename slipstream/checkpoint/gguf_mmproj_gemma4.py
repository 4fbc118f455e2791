"""mmproj writer for Gemma 4's vision side (llama.cpp's `gemma4v` projector).

What llama.cpp's gemma4v graph (tools/mtmd/models/gemma4v.cpp, clip.cpp; llama-cpp-python
0.3.36) computes, and what that fixes for a checkpoint:
- pixels as 2x - 1 (the image processor only rescales: mean 0, std 1 in the file), the
  patch projection as a conv (transformers' Linear over (py, px, c) patches, reshaped to
  (D, c, p, p)), the (2, positions, D) table of x and y embeddings added;
- encoder layers with Gemma 4's sandwich RMSNorms (weights as they are: Gemma 4 scales by w),
  per-head q/k norms, a weightless v norm, attention scale 1, 2-D RoPE (x on the first half of
  each head, y on the second, rotate-half, base fixed at 100), tanh-GELU gated MLP, clamps
  of Gemma4ClippableLinear as scalar tensors beside each weight (`.input_min`, ...);
- average pooling by `pooling_kernel_size` (`projector.scale_factor`), times sqrt(D), the
  optional standardisation (`v.std_bias`, `v.std_scale`), a weightless RMSNorm and the
  embedder's projection (`mm.input_projection`, (text, vision) as transformers holds it).
Refused in one line: what that graph fixes otherwise (RoPE base, activation, KV heads, head
dim) and a text model whose image attention llama.cpp decides otherwise (mtmd decodes a Gemma 4
image bidirectionally on sliding layers unless the text width is 1536 or 2560, E2B/E4B;
transformers does so where `use_bidirectional_attention` is "vision"). An audio tower
(E2B/E4B) is not written: the file is the vision side only, which llama.cpp loads as such
(its audio encoder is optional in the same file).
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.checkpoint.gguf_mmproj_spec import MmprojSpec, graph_refusal, mmproj_names

CAUSAL_WIDTHS = (1536, 2560)  # text widths (E2B, E4B) mtmd decodes images causally for
ROPE_THETA = 100.0  # llama.cpp's gemma4v RoPE base (hparams.rope_theta, not read from the file)
KERNEL = 3  # llama.cpp's default pooling kernel (written when the config's differs)
CLAMPS = (".input_max", ".input_min", ".output_max", ".output_min")


def _vision(hf: dict) -> dict:
    v = hf["vision_config"]  # image_size: unused by gemma4v (its preprocessing is dynamic)
    return {**v, "image_size": 224, "layer_norm_eps": v.get("rms_norm_eps", 1e-6)}


def _check(hf: dict) -> str | None:
    v, text = hf.get("vision_config") or {}, hf.get("text_config") or {}
    differ = []
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", ROPE_THETA))
    if theta != ROPE_THETA:
        differ.append(f"the tower's RoPE base {theta:g} (llama.cpp: {ROPE_THETA:g})")
    if v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        differ.append(f"hidden_activation {v['hidden_activation']} (llama.cpp: tanh GELU)")
    heads, width = int(v["num_attention_heads"]), int(v["hidden_size"])
    if int(v.get("num_key_value_heads", heads)) != heads:
        differ.append(f"{v['num_key_value_heads']} KV heads of {heads} (llama.cpp: as many)")
    if int(v.get("head_dim", width // heads)) * heads != width:
        differ.append(f"head_dim {v['head_dim']} (llama.cpp: hidden_size / heads)")
    if differ:
        return graph_refusal("gemma4v", "tower", differ)
    vision_attention = text.get("use_bidirectional_attention") == "vision"
    if vision_attention != (int(text["hidden_size"]) not in CAUSAL_WIDTHS):
        how = "bidirectionally" if not vision_attention else "causally"
        return (
            f"llama.cpp decodes its images {how} (it decides by the text width, "
            f"{text['hidden_size']}), not as use_bidirectional_attention="
            f"{text.get('use_bidirectional_attention')!r} says"
        )
    return None


def _metadata(w: Any, hf: dict, processor: dict) -> None:
    """gemma4v's keys; the mean and std llama.cpp normalises with are 0 and 1 whatever the
    processor lists (it does not normalise: the graph maps [0, 1] to [-1, 1] itself)."""
    from gguf import Keys

    v = hf["vision_config"]
    if processor.get("do_normalize", False):
        raise ValueError(
            "GGUF mmproj: Gemma 4's image processor normalises (do_normalize): llama.cpp's "
            "gemma4v graph maps [0, 1] pixels to [-1, 1] itself."
        )
    w.kv_data[0].pop(Keys.ClipVision.IMAGE_MEAN, None)  # write_vision_metadata's
    w.kv_data[0].pop(Keys.ClipVision.IMAGE_STD, None)
    w.add_vision_image_mean([0.0] * 3)
    w.add_vision_image_std([1.0] * 3)
    w.add_vision_use_gelu(True)
    if int(v.get("pooling_kernel_size", KERNEL)) != KERNEL:
        w.add_vision_projector_scale_factor(int(v["pooling_kernel_size"]))


def _rename(name: str, t: torch.Tensor, hf: dict) -> Any:
    """llama.cpp's converter's renaming (Gemma4VisionAudioModel.modify_tensors), then the gguf
    package's mmproj table; an audio tower (E2B/E4B) is not written: the file is vision only."""

    if not name.startswith(("vision_tower.", "embed_vision.")):
        return None
    name = ("model." + name).replace("model.vision_tower.encoder.", "vision_model.model.")
    name = name.replace(".linear.weight", ".weight")
    if name.endswith("position_embedding_table"):
        name += ".weight"
    if name.endswith("patch_embedder.input_proj.weight"):  # (D, p*p*3) over (py, px, c)
        D, n = t.shape
        p = round((n // 3) ** 0.5)
        t = t.reshape(D, p, p, 3).permute(0, 3, 1, 2).contiguous()
    out = mmproj_names().get_name(name, try_suffixes=(".weight", ".bias", *CLAMPS))
    if out is None:
        raise ValueError(f"GGUF mmproj: no llama.cpp name for Gemma 4 tensor {name!r}.")
    return out, t.reshape(1) if t.ndim == 0 else t.contiguous()  # clamp bounds: 1 element


GEMMA4V = MmprojSpec("gemma4v", _metadata, _rename, _vision, check=_check)
