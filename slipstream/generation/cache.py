"""KV cache for generation, shared by every model family.

The families need no generation code: each attention layer already calls
`ops.attention.attend(q, k, v, seq, window=..., sinks=..., scale=...)` with its own window
(sliding layers, Gemma 3 local/global), sinks (GPT-OSS) and scale. For a generation forward
the engine sets `seq.kv` to a step object below; `attend` hands it the layer's new keys and
values, it writes them into the cache and attends with the same window, sinks and scale the
family passed. LoRA/DoRA adapters (unmerged) and NF4 bases sit in the projections before
`attend`, so they work unchanged.

Layers are told apart by call order: a forward calls `attend` once per layer, first to last,
so the step counts its calls (checked at the end of the forward by `finish`).

Recurrent layers (Gated DeltaNet, Qwen3.5) hold no keys: their cache is a state per row, the
last J inputs of the causal conv and the (H, K, V) delta-rule state, counted apart by their
calls of `ops.gated_delta.causal_conv` (the step's `recurrent.conv`, then `.delta` for the
same layer).
Prefill runs the packed training path and keeps each sequence's final state; decode steps it
one token (generation/recurrent.py).

Layout: the cache of layer l is `k[l], v[l]` of shape (B, G, S, Dh): B rows (one per live
sequence), S = longest prompt + max_new_tokens positions. Rows are compacted when sequences
finish (`keep_rows`), so finished sequences stop costing attention work. G and Dh are the
layer's own (`model.kv_layout()`: Gemma 4's full layers have other head dims than its sliding
ones); a layer that reuses an earlier layer's keys and values (Gemma 4's K/V sharing) has no
cache of its own (`k[l]` None) and reads that layer's (`source[l]`), writing nothing.

Shapes: T packed prompt tokens, B rows, H query heads, G kv heads, R = H // G, S cache
positions, L keys attended this step, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.generation.recurrent import RecurrentDecode, RecurrentPrefill, RecurrentState
from slipstream.models.gated_deltanet import recurrent_state_shapes
from slipstream.ops.attention import _sdpa_per_sequence as sdpa_per_sequence
from slipstream.ops.attention import attend_packed
from slipstream.ops.packing import SeqInfo

KEY_ALIGN = 16


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class KVCache:
    """Keys and values of every layer for B rows of up to S positions each."""

    def __init__(self, layout: list[tuple[int, int, int]], rows: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, states=()) -> None:  # fmt: skip
        """`layout`: (kv heads, head dim, cache layer) of each attention layer, in call order
        (`model.kv_layout()`); `states`: the recurrent layers' (recurrent_state_shapes)."""
        self.source = [src for _, _, src in layout]
        assert all(self.source[s] == s for s in self.source), self.source

        def zeros(i: int, G: int, Dh: int) -> torch.Tensor | None:
            shape = (rows, G, max_len, Dh)
            return torch.zeros(shape, dtype=dtype, device=device) if self.source[i] == i else None

        self.k = [zeros(i, G, Dh) for i, (G, Dh, _) in enumerate(layout)]
        self.v = [zeros(i, G, Dh) for i, (G, Dh, _) in enumerate(layout)]
        self.max_len = max_len
        self.state = RecurrentState(rows, states, dtype, device)

    @classmethod
    def for_model(cls, model, rows: int, max_len: int) -> KVCache:
        cfg = model.config
        stateful = getattr(model, "per_sequence", ())  # generic: linear attention, SSM, conv
        if stateful:
            raise ValueError(
                f"generation: {cfg.model_type}'s {stateful[0]} is not softmax attention and "
                "slipstream's KV cache holds no state for it yet; generate with transformers."
            )
        emb = model.input_embeddings().weight  # activations (hence q, k, v) take its dtype
        states = recurrent_state_shapes(model)  # Gated DeltaNet layers: no keys, a state
        layout = model.kv_layout()
        if states:  # uniform shapes: one entry per attention layer, in call order
            layout = [(G, Dh, i) for i, (G, Dh, _) in enumerate(layout[len(states) :])]
        return cls(layout, rows, max_len, emb.dtype, emb.device, states)

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    def keep_rows(self, rows_B: torch.Tensor) -> None:
        """Keep (and reorder/repeat) the rows `rows_B` (int64 on the cache's device)."""
        self.k = [k if k is None else k.index_select(0, rows_B) for k in self.k]
        self.v = [v if v is None else v.index_select(0, rows_B) for v in self.v]
        self.state.keep_rows(rows_B)


class _Step:
    """One forward's view of the cache: counts the layers as `attend` reaches them."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.layer = cache, 0
        self.recurrent = RecurrentDecode(cache.state)  # Prefill sets its own

    def next_layer(self) -> int:
        layer, self.layer = self.layer, self.layer + 1
        return layer

    def finish(self) -> None:
        assert self.layer == len(self.cache.k), (
            f"KV cache: the forward called attend {self.layer} times for "
            f"{len(self.cache.k)} layers (each layer must call it once)"
        )
        self.recurrent.finish()


class Prefill(_Step):
    """Prompts packed as one `SeqInfo`: row `rows[i]` of the cache takes sequence i.

    Attention is the training path (varlen/flex on CUDA, SDPA on CPU) over the packed prompts;
    the keys and values are scattered into the cache by host-built (row, position) indices.
    """

    def __init__(self, cache: KVCache, seq: SeqInfo, rows: list[int]) -> None:
        super().__init__(cache)
        self.seq = seq
        row_T = [r for r, n in zip(rows, seq.lengths, strict=True) for _ in range(n)]
        self.row_T = torch.tensor(row_T).to(seq.device, non_blocking=True)
        rows_N = torch.tensor(rows).to(seq.device, non_blocking=True)
        self.recurrent = RecurrentPrefill(cache.state, seq, rows_N)
        self.pos_T = seq.position_ids

    def attend(self, q_THD, k_TGD, v_TGD, window=None, sinks=None, scale=None):
        layer = self.next_layer()
        if self.cache.source[layer] == layer:  # else k, v are the source layer's, cached
            # Integer (row, position) indices: an index_put_ with no host sync.
            self.cache.k[layer][self.row_T, :, self.pos_T] = k_TGD
            self.cache.v[layer][self.row_T, :, self.pos_T] = v_TGD
        if not q_THD.is_cuda and sinks is None and self.seq.num_seqs > 1:
            # CPU: one causal SDPA call per prompt. The packed path's dense (T, T) mask would
            # score every prompt against every other: at 16 prompts of 16..128 tokens that is
            # 1152^2 scores a head where the prompts need 0.2 of them.
            return sdpa_per_sequence(q_THD, k_TGD, v_TGD, self.seq, window, scale)
        return attend_packed(q_THD, k_TGD, v_TGD, self.seq, window, sinks, scale)


class Decode(_Step):
    """One new token per row at position `pos_B` (device); keys 0..pos_B[b] are visible.

    `max_pos` / `min_pos` (host ints, the engine knows them without asking the device) bound
    the keys read: none after max_pos, and for a sliding layer none before
    min_pos - window + 1 (each end rounded out to a multiple of 16).
    """

    def __init__(self, cache: KVCache, pos_B: torch.Tensor, min_pos: int, max_pos: int) -> None:
        super().__init__(cache)
        self.pos_B, self.min_pos = pos_B, min_pos
        # Keys read: [lo, hi) with both ends on multiples of 16 (CUDA's memory-efficient SDPA
        # wants the mask's last dim aligned so; the extra keys are masked out).
        self.hi = min(cache.max_len, _round_up(max_pos + 1, KEY_ALIGN))
        self.rows_B = torch.arange(pos_B.shape[0], device=pos_B.device)
        self.masks: dict[int | None, tuple[int, torch.Tensor]] = {}

    def mask(self, window: int | None) -> tuple[int, torch.Tensor]:
        """(lo, (B, 1, 1, L - lo) bool): the keys from position lo that each row may see.
        Built once per step and window, shared by the layers."""
        if window not in self.masks:
            lo = 0 if window is None else max(0, self.min_pos - window + 1)
            lo -= lo % KEY_ALIGN
            key_L = torch.arange(lo, self.hi, device=self.pos_B.device)
            delta_BL = self.pos_B[:, None] - key_L[None, :]
            ok_BL = delta_BL >= 0 if window is None else (delta_BL >= 0) & (delta_BL < window)
            self.masks[window] = (lo, ok_BL[:, None, None, :])
        return self.masks[window]

    def attend(self, q_BHD, k_BGD, v_BGD, window=None, sinks=None, scale=None):
        layer = self.next_layer()
        source = self.cache.source[layer]
        K, V = self.cache.k[source], self.cache.v[source]
        if source == layer:  # else the source layer wrote this step's k, v already
            K[self.rows_B, :, self.pos_B] = k_BGD
            V[self.rows_B, :, self.pos_B] = v_BGD
        lo, mask_B11L = self.mask(window)
        K_BGLD, V_BGLD = K[:, :, lo : self.hi], V[:, :, lo : self.hi]
        B, H, Dh = q_BHD.shape
        G = K.shape[1]
        # The R query heads that share a kv head attend as R queries of that head: no
        # repeated keys and no GQA flag, so every SDPA kernel of torch >= 2.0 takes it.
        q_BGRD = q_BHD.view(B, G, H // G, Dh)
        if sinks is None:
            o_BGRD = F.scaled_dot_product_attention(
                q_BGRD, K_BGLD, V_BGLD, attn_mask=mask_B11L, scale=scale
            )
        else:
            o_BGRD = _attend_with_sinks(q_BGRD, K_BGLD, V_BGLD, mask_B11L, sinks, scale)
        return o_BGRD.reshape(B, H, Dh)


def _attend_with_sinks(q_BGRD, K_BGLD, V_BGLD, mask_B11L, sinks_H, scale):
    """Softmax over [scores, sink] for one query per row (GPT-OSS), written out."""
    B, G, R, Dh = q_BGRD.shape
    scale = Dh**-0.5 if scale is None else scale
    scores = (q_BGRD.float() @ K_BGLD.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask_B11L, float("-inf"))
    sink_BGR1 = sinks_H.float().view(1, G, R, 1).expand(B, G, R, 1)
    probs = torch.softmax(torch.cat([scores, sink_BGR1], dim=-1), dim=-1)[..., :-1]
    return (probs.to(V_BGLD.dtype) @ V_BGLD).to(q_BGRD.dtype)


def decode_seq(pos_B: torch.Tensor, kv: Decode) -> SeqInfo:
    """A `SeqInfo` of B one-token sequences at positions `pos_B`, carrying the decode step."""
    B = pos_B.shape[0]
    ar = torch.arange(B + 1, dtype=torch.int32, device=pos_B.device)
    return SeqInfo(lengths=(1,) * B, cu_seqlens=ar, max_seqlen=1,
                   position_ids=pos_B, seq_ids=ar[:B], kv=kv)  # fmt: skip
