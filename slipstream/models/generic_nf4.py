"""QLoRA's NF4 base weights on the generic family: transformers' own bitsandbytes quantizer,
set up as native QLoRA (peft/qlora.py) quantises.

transformers quantises each `nn.Linear` of the meta-built model into a bitsandbytes
`Linear4bit` as its weight streams in (so the full-precision model is never held), with the
settings of native QLoRA: NF4, blocksize 64 (bitsandbytes' default, which transformers
keeps), double quantisation, compute dtype = the model dtype, uint8 storage. Which linears:
those inside the decoder layers; not the routers (`*gate`, `*router`: a shared expert's
one-output gate), and nothing outside the layers (the head, a vision tower). Embeddings,
norms, biases and stacked MoE experts (parameters, not linears) stay in full precision.
A checkpoint saved by transformers + bitsandbytes loads in its own 4-bit form.
"""

from __future__ import annotations

import torch
from torch import nn

ROUTER_SUFFIXES = ("gate", "router")  # full-precision linears inside the layers


def nf4_config(config, dtype: torch.dtype, decoder_of, trust_remote_code: bool = False):
    """transformers' BitsAndBytesConfig for `config`: NF4 on the linears inside the decoder
    layers that `decoder_of(model)` -> (backbone, layers) finds (generic.decoder_of)."""
    import re

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):  # names only: no storage
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    _, layers = decoder_of(skeleton)
    inside = {id(m) for m in layers.modules()}
    keep = [
        name for name, m in skeleton.named_modules()
        if (type(m) is nn.Linear or isinstance(m, Conv1D))
        and (id(m) not in inside or name.rsplit(".", 1)[-1].endswith(ROUTER_SUFFIXES))
    ]  # fmt: skip
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8,
        llm_int8_skip_modules=[re.escape(name) + "$" for name in keep],
    )  # fmt: skip


def one_cpu_path(model: nn.Module) -> None:
    """bitsandbytes' AVX512-bf16 CPU inference path repacks a weight in place on the first
    eval forward (absmax rounded to bf16): eval and train forwards would disagree. Off, as
    native QLoRA does (peft/qlora.py)."""
    for m in model.modules():
        if type(m).__name__ == "Linear4bit":
            m.support_avx512bf16_for_cpu = False


def forget_quantization(hf_model: nn.Module) -> None:
    """After `peft.qlora.dequantize_model`: a model with no 4-bit layer left saves as a
    full-precision checkpoint (no `quantization_config`). transformers' own
    `remove_quantization_config` would also drop the checkpoint conversions (stacked MoE
    experts back to per-expert tensors) that `save_pretrained` applies: kept here."""
    if getattr(hf_model, "hf_quantizer", None) is None:
        return
    if any(type(m).__name__ == "Linear4bit" for m in hf_model.modules()):
        return  # still quantised: transformers saves the 4-bit checkpoint
    del hf_model.hf_quantizer
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.is_quantized = False
