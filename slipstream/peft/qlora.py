"""QLoRA base weights: NF4 linear layers (bitsandbytes), quantised while a checkpoint loads.

`load_model(path, quantize="nf4")` builds the model on the meta device, swaps each targeted
`nn.Linear` inside the decoder layers for an empty bitsandbytes `Linear4bit`
(`quantize_linear_targets`), and quantises each weight the moment it arrives from the
checkpoint, so host memory holds the packed model plus one full-precision tensor, never the
full-precision model. Checkpoints saved by transformers + bitsandbytes (config.json
`quantization_config.quant_method == "bitsandbytes"`, `load_in_4bit`) load as they are: the
packed `*.weight` and its `absmax`/`quant_map`/`nested_*`/`quant_state.bitsandbytes__*`
companions become a `Params4bit` directly, without a round trip through full precision.

Conventions: blocksize 64, double quantisation (the absmax are themselves 8-bit quantised),
compute dtype = the model dtype (`model.dtype: auto`: bf16 on GPU and on bf16-capable
CPUs). Embeddings, norms, lm_head, biases and MoE experts stay in full precision.
`dequantize_model` turns the NF4 layers back into `nn.Linear` (for merged export: dequantise,
then merge LoRA; never re-quantise).
bitsandbytes is imported only when quantisation is used (`pip install 'slipstream[qlora]'`).
"""

from __future__ import annotations

import ctypes
from types import ModuleType

import torch
from torch import nn

from slipstream.models.weights import check_shape

# The decoder's projections, Phi-3's fused qkv_proj/gate_up_proj included.
NF4_TARGETS = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj",
    "gate_proj", "up_proj", "gate_up_proj", "down_proj",
)  # fmt: skip
BLOCKSIZE = 64
# The NF4 settings every quantised weight is made with (bitsandbytes' keyword names).
NF4 = {"blocksize": BLOCKSIZE, "compress_statistics": True, "quant_type": "nf4"}
INSTALL_HINT = "pip install 'slipstream[qlora]' (or: pip install bitsandbytes)"
# Companions of a packed `<module>.weight` in a bitsandbytes checkpoint.
QUANT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def require_bitsandbytes(what: str = "quantize='nf4'") -> ModuleType:
    """bitsandbytes, or a one-line ValueError naming `what` needs it and the install command."""
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError(
            f"{what} needs bitsandbytes, which is not installed: {INSTALL_HINT}"
        ) from None
    return bitsandbytes


def has_4bit_weights(model: nn.Module) -> bool:
    """Whether any parameter is a bitsandbytes 4-bit one (checked by type name: no import)."""
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def is_prequantized(hf: dict) -> bool:
    """True for a config.json written by transformers with a bitsandbytes 4-bit model."""
    qc = hf.get("quantization_config") or {}
    return qc.get("quant_method") == "bitsandbytes" and bool(qc.get("load_in_4bit"))


def check_quantize(quantize: str | None, hf: dict, source: str) -> str | None:
    """The quantisation to apply ("nf4" or None), or a one-line ValueError."""
    if quantize in (None, "none"):
        quantize = None
    elif quantize != "nf4":
        raise ValueError(f"quantize={quantize!r} is not supported; use None or 'nf4'.")
    qc = hf.get("quantization_config") or {}
    if qc.get("quant_method") == "bitsandbytes" and qc.get("load_in_8bit"):
        raise ValueError(
            f"{source}: 8-bit bitsandbytes checkpoints are not supported; "
            "load the original checkpoint with quantize='nf4'."
        )
    # A pre-quantised checkpoint loads in the 4-bit form it is stored in.
    return "nf4" if quantize or is_prequantized(hf) else None


def quantize_linear_targets(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype,
    targets: tuple[str, ...] = NF4_TARGETS,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Swap each targeted nn.Linear in the decoder layers for an empty NF4 Linear4bit.

    Call on the meta-device model before `to_empty`: the placeholder weight has the packed
    shape (one uint8 per two weights), so no full-precision storage is ever allocated.
    Returns the module names replaced.
    """
    bnb = require_bitsandbytes()
    replaced = []
    for name, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            full = f"{name}.{attr}" if name else attr
            if not (type(child) is nn.Linear and attr in targets and ".layers." in f".{full}"):
                continue
            if any(s and s in full for s in skip):
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=False,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
                device="meta",
            )
            nbytes = (child.weight.numel() + 1) // 2  # one uint8 holds two 4-bit weights
            packed = torch.empty((nbytes, 1), dtype=torch.uint8, device="meta")
            q.weight = bnb.nn.Params4bit(packed, requires_grad=False, module=q, **NF4)
            q.bias = child.bias  # stays full precision, filled by the normal loader
            # bitsandbytes' AVX512-bf16 CPU inference path repacks the weight in place on the
            # first eval forward (absmax rounded to bf16, out_features % 32 == 0 required):
            # eval and train forwards would disagree and saved weights change. Keep one path.
            q.support_avx512bf16_for_cpu = False
            setattr(module, attr, q)
            replaced.append(full)
    return replaced


def set_nf4_weight(module: nn.Module, tensor: torch.Tensor, name: str, source: str) -> None:
    """Quantise a full-precision weight (out, in) to NF4 into `module` (a Linear4bit)."""
    bnb = require_bitsandbytes()
    check_shape(name, tensor.shape, (module.out_features, module.in_features), source)
    device = module.weight.device
    w = tensor.to(device=device, dtype=module.compute_dtype)
    packed, state = bnb.functional.quantize_4bit(w, quant_storage=torch.uint8, **NF4)
    module.weight = bnb.nn.Params4bit(
        packed, requires_grad=False, quant_state=state, quant_storage=torch.uint8,
        bnb_quantized=True, module=module, **NF4,
    )  # fmt: skip
    module.quant_state = state
    if device.type == "cpu":
        del tensor, w
        _release_freed_heap()


def _release_freed_heap() -> None:
    """Hand freed heap pages back to the OS (glibc only; elsewhere a no-op).

    Quantising on the CPU leaves each weight's float32 transients in the heap, pinned between
    small long-lived allocations (absmax, quant states): on a 106M-parameter load that kept
    ~110 MB of freed memory resident, as much as the whole NF4 model.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = lambda pad: 0
    _malloc_trim(0)


_malloc_trim = None


def load_prequantized_tensor(
    module: nn.Module, pieces: dict[str, torch.Tensor], name: str, source: str
) -> None:
    """Install a packed bitsandbytes weight (+ its quant-state pieces) into `module`.

    A Linear4bit takes the packed data as is; a full-precision module (one we do not
    quantise, e.g. a router) gets this one tensor dequantised into its weight.
    """
    bnb = require_bitsandbytes()
    device = module.weight.device
    stats = {k: v for k, v in pieces.items() if k != "weight"}
    if isinstance(module, bnb.nn.Linear4bit):
        module.weight = bnb.nn.Params4bit.from_prequantized(
            pieces["weight"], stats, requires_grad=False, device=device, module=module
        )
        expected = (module.out_features, module.in_features)
        check_shape(name, module.weight.quant_state.shape, expected, source)
        return
    state = bnb.functional.QuantState.from_dict(stats, device=device)
    w = bnb.functional.dequantize_4bit(pieces["weight"].to(device), state)
    check_shape(name, w.shape, module.weight.shape, source)
    module.weight.copy_(w)


class NF4Loader:
    """The quantising side of `load_model`: takes the tensors that belong to NF4 layers.

    `replace_targets(model)` on the meta model; `take(name, tensor)` for each checkpoint
    tensor (False: not ours, load it normally); `finish()` -> names of the weights it filled.
    """

    def __init__(self, hf: dict, dtype: torch.dtype, source: str) -> None:
        require_bitsandbytes()  # fail before any work is done
        self.prequantized = is_prequantized(hf)
        qc = hf.get("quantization_config") or {}
        self.skip = tuple(qc.get("llm_int8_skip_modules") or ()) if self.prequantized else ()
        self.compute_dtype = dtype
        self.source = source
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> pieces so far
        self.loaded: list[str] = []

    def replace_targets(self, model: nn.Module) -> None:
        self.model = model
        # An image-text model's vision side stays in full precision, as its LoRA stays off it
        # by default (Gemma 3's SigLIP: `no_lora_prefixes`).
        skip = self.skip + tuple(getattr(model, "no_lora_prefixes", ()))
        self.targets = set(
            quantize_linear_targets(model, compute_dtype=self.compute_dtype, skip=skip)
        )

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        module_name, piece = _split_quant_name(name)
        if module_name is None:
            return False
        if piece == "weight" and tensor.is_floating_point():
            if module_name not in self.targets:
                return False  # a full-precision layer: the normal loader copies it
            set_nf4_weight(self.model.get_submodule(module_name), tensor, name, self.source)
            self.loaded.append(name)
            return True
        if piece == "weight" and not self.prequantized:
            return False
        pieces = self.pending.setdefault(module_name, {})
        pieces[piece] = tensor
        if _complete(pieces):
            try:
                module = self.model.get_submodule(module_name)
            except AttributeError:
                raise ValueError(f"{self.source}: unexpected tensor {name!r}.") from None
            weight = f"{module_name}.weight"
            load_prequantized_tensor(module, self.pending.pop(module_name), weight, self.source)
            self.loaded.append(weight)
        return True

    def finish(self) -> list[str]:
        if self.pending:
            name, pieces = next(iter(self.pending.items()))
            raise ValueError(
                f"{self.source}: quantised weight {name}.weight is incomplete "
                f"(has {sorted(pieces)}); the checkpoint is truncated."
            )
        return self.loaded


def _split_quant_name(name: str) -> tuple[str | None, str]:
    """'a.b.weight.absmax' -> ('a.b', 'absmax'); 'a.b.weight' -> ('a.b', 'weight')."""
    head, sep, tail = name.partition(".weight.")
    if sep and (tail in QUANT_SUFFIXES or tail.startswith("quant_state.bitsandbytes__")):
        return head, tail
    if name.endswith(".weight"):
        return name.removesuffix(".weight"), "weight"
    return None, ""


def _complete(pieces: dict[str, torch.Tensor]) -> bool:
    blob = next((k for k in pieces if k.startswith("quant_state.")), None)
    if blob is None or not {"weight", "absmax", "quant_map"} <= pieces.keys():
        return False
    from bitsandbytes.utils import unpack_tensor_to_dict

    nested = "nested_blocksize" in unpack_tensor_to_dict(pieces[blob])
    return not nested or {"nested_absmax", "nested_quant_map"} <= pieces.keys()


def dequantize_weight(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A Linear4bit's weight (out, in) dequantised, in `dtype` (default: its compute dtype)."""
    bnb = require_bitsandbytes()
    state = module.weight.quant_state
    assert not getattr(state, "packing_format_for_cpu", False), "repacked CPU NF4 weight"
    w = bnb.functional.dequantize_4bit(module.weight.data, state)
    return w.to(dtype or module.compute_dtype or state.dtype)


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every Linear4bit by an nn.Linear holding its dequantised weight, in place.

    dtype: the new weights' dtype (default: each layer's compute dtype, bf16 on GPU and
    float32 on CPU). For merged export; LoRA wrappers keep wrapping the new base layers.
    """
    bnb = require_bitsandbytes()
    for module in list(model.modules()):
        for attr, child in list(module.named_children()):
            if not isinstance(child, bnb.nn.Linear4bit):
                continue
            w = dequantize_weight(child, dtype)
            out_dtype = w.dtype
            linear = nn.Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                device=w.device,
                dtype=out_dtype,
            )
            with torch.no_grad():
                linear.weight.copy_(w)
                if child.bias is not None:
                    linear.bias.copy_(child.bias)
            linear.requires_grad_(False)
            setattr(module, attr, linear)
    hf = getattr(getattr(model, "config", None), "hf", None)
    if isinstance(hf, dict):  # a saved copy must not claim to be a bitsandbytes checkpoint
        hf.pop("quantization_config", None)
    return model
