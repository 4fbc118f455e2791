"""What the generic family registers with transformers and wraps around its modules: the
packed-sequence attention function, the per-sequence run of token mixers that are not softmax
attention, and the scope that hands each decoder layer's `SeqInfo` down to them.

transformers' layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k,
v, mask, scaling=, sliding_window=, softcap=, s_aux=, **kwargs)`; the kwargs are the ones the
model's forward received, so the batch's host-built `SeqInfo` (`SEQ_KWARG`) reaches every layer
with no mask built: a name not in `AttentionMaskInterface` makes transformers' mask builders
return None before they look at position ids, so `find_packed_sequence_indices` (a host sync)
never runs.

Shapes: B batch (always 1: the packed stream), H query heads, G kv heads, T tokens, Dh head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re

import torch
from torch import nn

from slipstream.ops.attention import attend
from slipstream.ops.moe import grouped_mm, permute, plan, unpermute
from slipstream.ops.packing import SeqInfo

ATTENTION = "slipstream"  # our name in transformers' AttentionInterface
EXPERTS = "slipstream"  # and in its ExpertsInterface
SEQ_KWARG = "slipstream_seq"  # the forward kwarg that carries the batch's SeqInfo
# The SeqInfo of the decoder layer running now, for modules whose caller drops the kwargs
# (a token mixer called with its own arguments only). Set around each layer's forward, so
# a recompute in backward (checkpointing, offload) sees its own batch's.
_CURRENT: contextvars.ContextVar[SeqInfo | None] = contextvars.ContextVar(SEQ_KWARG, default=None)
# The SeqInfo of the packed forward running now (`packed_batch`), for the decoder layers of a
# backbone that does not pass its forward's kwargs on (Mamba's, RWKV's): a pre-hook puts it
# into each layer's kwargs, so a checkpoint's recompute, which replays them, has it too.
_BATCH: contextvars.ContextVar[SeqInfo | None] = contextvars.ContextVar("batch", default=None)

# Token mixers that carry state along the sequence (linear attention, SSMs, short
# convolutions), by class-name suffix. Their torch implementations (the only ones on CPU)
# read no packed boundaries, so they run once per packed sequence: state never crosses one.
PER_SEQUENCE_MIXERS = (
    "GatedDeltaNet", "ShortConv", "MambaMixer", "Mamba2Mixer", "Mixer", "LinearAttention",
    "MambaLayer", "LightningAttention", "RwkvSelfAttention", "RwkvFeedForward",
)  # fmt: skip
# What else marks a module that carries state along the sequence: a CamelCase piece of its
# class name (recurrent blocks, RNNs, SSMs, linear/delta attention, short convolutions) or
# being an nn.Conv1d. One not inside a wrapped mixer would pass state from one packed sequence
# into the next unseen (Granite 4's Mamba layers, MiniMax's lightning attention and RWKV's
# time mixing did, packed logits off by 59%, 57% and 63% relative, before their names were
# added above), so such a model is refused in one line (`check_packable`).
STATEFUL = re.compile(
    r"Recurrent|Rglru|Rwkv|LSTM|Lstm|Mamba|Mixer|Delta|ShortConv|Lightning|Retention|Ssm|SSM"
    r"|Hyena|LinearAttention"
)


def current_seq(kwargs: dict) -> SeqInfo | None:
    return kwargs.get(SEQ_KWARG) or _CURRENT.get()


def slipstream_attention(
    module: nn.Module,
    query_BHTD: torch.Tensor,
    key_BGTD: torch.Tensor,
    value_BGTD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over `attend`: -> ((1, T, H, Dh), None).
    Under sequence parallelism `seq` is this rank's shard and `attend` does the all-to-alls
    around the whole batch's attention (ops/ulysses.py)."""
    seq = current_seq(kwargs)
    if seq is None:
        raise ValueError(
            f"{type(module).__name__}: the slipstream attention function needs the batch's "
            "SeqInfo; call the model as model(input_ids, seq), not transformers' forward."
        )
    if dropout and module.training:
        raise ValueError(
            f"{type(module).__name__}: attention dropout {dropout} is not supported on the "
            "packed path; set attention_dropout to 0 in config.json."
        )
    q_THD, k_TGD, v_TGD = (x[0].transpose(0, 1) for x in (query_BHTD, key_BGTD, value_BGTD))
    window = sliding_window if sliding_window else None  # transformers passes 0/None: full
    seq = chunked(module, seq)
    # Gemma 4 (use_bidirectional_attention "vision"): images are bidirectional on its
    # sliding layers only; its full layers stay causal (transformers' vision masks).
    vision_only = getattr(getattr(module, "config", None), "use_bidirectional_attention", None)
    spans = window is not None or vision_only != "vision"
    o_THD = attend(
        q_THD, k_TGD, v_TGD, seq, window=window, sinks=s_aux, scale=scaling, softcap=softcap,
        image_spans=spans,
    )  # fmt: skip
    return o_THD[None], None


def chunked(module: nn.Module, seq: SeqInfo) -> SeqInfo:
    """The packing a layer of chunked attention (Llama 4's `chunked_attention` layers: a token
    sees only its own `attention_chunk_size`-token chunk of its sequence) attends over: each
    sequence cut into chunks from its first token, as further packed sequences (host lengths,
    built once a batch). transformers applies the chunks in its mask alone, which our
    attention does not get; `seq` itself for every other layer."""
    config = getattr(module, "config", None)
    kinds, i = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not kinds or i is None or kinds[i] != "chunked_attention":
        return seq
    size = int(config.attention_chunk_size)
    longest = seq.max_seqlen if seq.shard is None else seq.shard.full.max_seqlen
    if longest <= size:
        return seq
    if seq.kv is not None or seq.shard is not None:
        raise ValueError(
            f"{type(module).__name__}: chunked attention over {longest} tokens "
            f"(attention_chunk_size {size}) is not supported with a KV cache or sequence "
            "parallelism here; keep sequences within the chunk size."
        )
    lengths = [min(size, n - s) for n in seq.lengths for s in range(0, n, size)]
    return seq.cached(
        ("chunked_attention", size), lambda: SeqInfo.from_lengths(lengths, seq.device)
    )


def is_standard_experts(module: nn.Module | None) -> bool:
    """Whether `module` is a transformers experts module (dispatching through its
    ExpertsInterface) with the standard stacked layout: `gate_up_proj` (E, 2I, D) [gate; up],
    `down_proj` (E, D, I), no biases, not transposed, no post-expert norm."""
    return bool(
        getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
        and not module.has_bias and not module.is_transposed
        and not module.has_post_expert_norm and not module._is_expert_parallel
    )  # fmt: skip


def one_pass(
    experts: nn.Module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
    delta=None,
) -> torch.Tensor:  # fmt: skip
    """Standard stacked experts over ops.moe's one pass (stable sort, counts by scatter_add,
    grouped GEMMs over device offsets, no host sync). `delta(name, x_RI, plan)`, when given,
    is added to each projection's output (expert LoRA: peft/lora_experts.py)."""
    p = plan(ids_TK, experts.num_experts)
    x_RD = permute(x_TD, p)
    h_RF = grouped_mm(x_RD, experts.gate_up_proj.transpose(1, 2), p.offsets_E)
    if delta is not None:
        h_RF = h_RF + delta("gate_up_proj", x_RD, p)
    a_RI = experts._apply_gate(h_RF)
    y_RD = grouped_mm(a_RI, experts.down_proj.transpose(1, 2), p.offsets_E)
    if delta is not None:
        y_RD = y_RD + delta("down_proj", a_RI, p)
    return unpermute(y_RD, p, weights_TK.to(y_RD.dtype)).to(x_TD.dtype)


def slipstream_experts(
    self: nn.Module, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-function signature over `one_pass` for the standard stacked
    layout; other layouts run transformers' own grouped_mm forward."""
    if not is_standard_experts(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, x_TD, ids_TK, weights_TK)
    return one_pass(self, x_TD, ids_TK, weights_TK)


def register() -> None:
    """Register the attention and experts functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(ATTENTION, slipstream_attention)
    ExpertsInterface.register(EXPERTS, slipstream_experts)


def implementations(model_class) -> dict[str, str]:
    """from_config/from_pretrained kwargs: our attention, and our experts where the model's
    experts dispatch through transformers' ExpertsInterface."""
    kwargs = {"attn_implementation": ATTENTION}
    if model_class._can_set_experts_implementation():
        kwargs["experts_implementation"] = EXPERTS
    return kwargs


@contextlib.contextmanager
def packed_batch(seq: SeqInfo):
    """While the backbone runs over the packed batch `seq` (the decoder layers' pre-hook)."""
    token = _BATCH.set(seq)
    try:
        yield
    finally:
        _BATCH.reset(token)


def _hand_seq(layer: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a decoder layer: the batch's SeqInfo where the backbone dropped it."""
    seq = _BATCH.get()
    if seq is None or SEQ_KWARG in kwargs:
        return None
    return args, {**kwargs, SEQ_KWARG: seq}


_TAKES_KWARGS: dict[type, bool] = {}


def _takes_kwargs(cls: type) -> bool:
    if cls not in _TAKES_KWARGS:
        params = inspect.signature(cls.forward).parameters.values()
        _TAKES_KWARGS[cls] = any(p.kind is p.VAR_KEYWORD for p in params)
    return _TAKES_KWARGS[cls]


def _scoped_forward(self, *args, **kwargs):
    token = _CURRENT.set(kwargs.get(SEQ_KWARG))
    base = type(self)._slipstream_scoped
    if not _takes_kwargs(base):  # a layer handed the SeqInfo by `_hand_seq` only (RWKV's)
        kwargs.pop(SEQ_KWARG, None)
    try:
        return base.forward(self, *args, **kwargs)
    finally:
        _CURRENT.reset(token)


def _per_sequence_forward(self, *args, **kwargs):
    """A token mixer run once per packed sequence (host lengths: no sync), outputs joined."""
    base = type(self)._slipstream_per_sequence.forward
    seq = current_seq(kwargs)
    kwargs.pop(SEQ_KWARG, None)
    if seq is None or seq.num_seqs == 1 or seq.kv is not None:
        return base(self, *args, **kwargs)
    key = None if args else "hidden_states"
    x_BTD = args[0] if args else kwargs.pop(key)
    outs = []
    for part in x_BTD.split(list(seq.lengths), dim=1):
        call_args = (part, *args[1:]) if key is None else args
        call_kwargs = kwargs if key is None else {**kwargs, key: part}
        outs.append(base(self, *call_args, **call_kwargs))
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=1)
    return (torch.cat([o[0] for o in outs], dim=1), *outs[0][1:])


_CLASSES: dict[tuple[type, str], type] = {}


def _swap(module: nn.Module, kind: str, forward) -> None:
    """Swap `module`'s class for a subclass with `forward` (names and hooks unchanged)."""
    cls = type(module)
    if (cls, kind) not in _CLASSES:
        attrs = {"forward": forward, f"_slipstream_{kind}": cls}
        _CLASSES[(cls, kind)] = type(
            f"{kind.title().replace('_', '')}{cls.__name__}", (cls,), attrs
        )
    module.__class__ = _CLASSES[(cls, kind)]


def scope_layers(layers: nn.ModuleList) -> None:
    """Each decoder layer publishes its SeqInfo to the modules inside it while it runs."""
    for layer in layers:
        _swap(layer, "scoped", _scoped_forward)
        layer.register_forward_pre_hook(_hand_seq, with_kwargs=True)


def per_sequence_mixers(layers: nn.ModuleList) -> list[str]:
    """Wrap every stateful token mixer inside `layers` to run per sequence; their names."""
    found = []
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            inside = any(name.startswith(f"{n}.") for _, n in found if _ == i)
            if name and not inside and type(module).__name__.endswith(PER_SEQUENCE_MIXERS):
                found.append((i, name))
                _swap(module, "per_sequence", _per_sequence_forward)
    return [f"layers.{i}.{name}" for i, name in found]


def check_packable(layers: nn.ModuleList, wrapped: list[str], model_type: str) -> None:
    """A one-line ValueError naming the first module inside `layers` that carries state along
    the sequence (`STATEFUL`; norms are not) and is neither a per-sequence mixer (`wrapped`,
    as `per_sequence_mixers` returns them) nor inside or around one: slipstream always packs,
    and it would pass state from one sequence into the next."""
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            path, cls = f"layers.{i}.{name}", type(module).__name__
            near = any(
                path == w or path.startswith(f"{w}.") or w.startswith(f"{path}.") for w in wrapped
            )
            stateful = isinstance(module, nn.Conv1d) or (
                STATEFUL.search(cls) and not re.search(r"Norm(Gated)?$", cls)
            )
            if name and stateful and not near:
                raise ValueError(
                    f"model_type {model_type!r}: {path} ({cls}) carries state along the "
                    "sequence and slipstream cannot run it once per packed sequence, so "
                    "packed sequences would share its state; this model cannot be trained by "
                    "slipstream's generic path."
                )
