"""Gated DeltaNet over packed sequences: the causal depthwise conv and the gated delta rule,
each restarting at every sequence boundary of a host-built `SeqInfo`.

The gated delta rule (Yang et al. 2024, "Gated Delta Networks"), per head, state S (K, V):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
with q, k L2-normalised and q scaled by K^-0.5 (transformers' and fla's convention). S is zero
at the first token of every packed sequence.

Three implementations, one result:
- `chunk_gated_delta`: the chunked (WY / UT-transform) form for training and prefill, in
  torch. Each sequence is cut into chunks of Q tokens (its last one padded); the intra-chunk
  work runs batched over all M chunks of the batch, and only the scan that carries S from one
  chunk to the next is a loop: over chunk *steps*, not chunks. Sequences are ordered by
  chunk count, longest first, and the chunks laid out step-major, so step j is a contiguous
  slice of the live sequences' j-th chunks and S[:n_j] their states (no gather, no sync;
  8 sequences of 512 tokens take 8 steps, not 64). Every index is built on the host from
  `seq.lengths`, once per SeqInfo (`seq.cached`).
- `fla`'s `chunk_gated_delta_rule` with `cu_seqlens` on CUDA, when flash-linear-attention is
  installed (feature-detected once by `fla_chunk_rule`: absent, or a kernel without
  `cu_seqlens`, and CUDA tensors take the torch form too).
- `delta_step`: the recurrence for one token per row (generation's decode).

`causal_conv` is the depthwise causal conv1d (kernel W) of the mixer's q/k/v channels as W
shifted multiply-adds, each tap masked where it would reach before its sequence's start.

Shapes: T packed tokens, N sequences, B rows (decode), H value heads, Hk key heads, K key
head dim, V value head dim, C conv channels, W conv width, Q chunk size, M chunks, J = W - 1.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from slipstream.ops.packing import SeqInfo

CHUNK = 64  # fla's chunk size; transformers' torch path uses the same


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ------------------------------------------------------------------ causal conv


def _conv_taps(seq: SeqInfo, W: int) -> torch.Tensor:
    """(W, T, 1) float: tap j of token t is live when t's position in its sequence is >= j."""

    def build() -> torch.Tensor:
        j = torch.arange(W, device=seq.device)[:, None, None]
        return (seq.position_ids[None, :, None] >= j).float()

    return seq.cached(("conv_taps", W), build)


def causal_conv(x_TC: torch.Tensor, weight_CW: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
    """Depthwise causal conv within each packed sequence (zero history at its start), no
    activation -> (T, C). weight_CW is nn.Conv1d's (C, 1, W) weight squeezed. When generating
    (`seq.kv` set) the step object keeps each sequence's last J inputs as its conv state."""
    if seq.kv is not None:
        return seq.kv.recurrent.conv(x_TC, weight_CW)
    return conv_packed(x_TC, weight_CW, seq)


def conv_packed(x_TC: torch.Tensor, weight_CW: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
    T, W = x_TC.shape[0], weight_CW.shape[1]
    taps_WT1 = _conv_taps(seq, W).to(x_TC.dtype)
    y_TC = x_TC * weight_CW[:, W - 1]
    for j in range(1, W):  # x[t - j] * w[W-1-j], where t - j is still in t's sequence
        shifted_TC = F.pad(x_TC[: T - j], (0, 0, j, 0)) if j < T else torch.zeros_like(x_TC)
        y_TC = y_TC + shifted_TC * taps_WT1[j] * weight_CW[:, W - 1 - j]
    return y_TC


def conv_tail_index(seq: SeqInfo, J: int) -> torch.Tensor:
    """(N, J) int64: each sequence's last J token indices, oldest first; T (a zero row) where
    the sequence is shorter than J. Host-built: a prefill's conv state is x_TC[index]."""

    def build() -> torch.Tensor:
        rows, end = [], 0
        for n in seq.lengths:
            end += n
            rows.append([end - J + i if end - J + i >= end - n else seq.total_tokens
                         for i in range(J)])  # fmt: skip
        return torch.tensor(rows, dtype=torch.int64).to(seq.device, non_blocking=True)

    return seq.cached(("conv_tail", J), build)


def conv_step(
    x_BC: torch.Tensor, state_BCJ: torch.Tensor, weight_CW: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row through the conv: -> (y_BC, the new state (B, C, J))."""
    window_BCW = torch.cat([state_BCJ, x_BC[:, :, None].to(state_BCJ.dtype)], dim=-1)
    y_BC = (window_BCW * weight_CW.to(window_BCW.dtype)).sum(-1)
    return y_BC.to(x_BC.dtype), window_BCW[:, :, 1:]


# ------------------------------------------------------------------ chunk layout


class ChunkLayout:
    """Where each token sits in the step-major chunk layout (module docstring), host-built.

    slot_T: (T,) the slot (chunk * Q + offset) of each token; token_S: (M*Q,) the token of
    each slot, T for padding; steps: [(first chunk, live sequences n_j)] per step;
    order: the sequences, longest first (sorted position -> original index); unsort_N: the
    sorted position of each sequence."""

    def __init__(self, lengths: tuple[int, ...], Q: int, device: torch.device) -> None:
        chunks = [-(-n // Q) for n in lengths]
        self.order = sorted(range(len(lengths)), key=lambda i: -chunks[i])
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        T, steps, token_S, slot_T = starts[-1], [], [], [0] * starts[-1]
        for j in range(chunks[self.order[0]]):
            live = [i for i in self.order if chunks[i] > j]
            steps.append((len(token_S) // Q, len(live)))
            for i in live:
                for o in range(Q):
                    t = j * Q + o
                    if t < lengths[i]:
                        slot_T[starts[i] + t] = len(token_S)
                    token_S.append(starts[i] + t if t < lengths[i] else T)
        self.steps, self.M, self.T = steps, len(token_S) // Q, T
        self.num_seqs = len(lengths)
        unsort = [0] * len(lengths)  # original index -> sorted position
        for pos, i in enumerate(self.order):
            unsort[i] = pos
        host = torch.tensor([*slot_T, *token_S, *unsort], dtype=torch.int64)
        buf = host.to(device, non_blocking=True)
        self.slot_T, self.token_S = buf[:T], buf[T : T + len(token_S)]
        self.unsort_N = buf[T + len(token_S) :]


def chunk_layout(seq: SeqInfo, Q: int) -> ChunkLayout:
    return seq.cached(("delta_chunks", Q), lambda: ChunkLayout(seq.lengths, Q, seq.device))


def _to_chunks(x_T_: torch.Tensor, lay: ChunkLayout, Q: int) -> torch.Tensor:
    """(T, ...) -> (M, Q, ...), padding slots zero."""
    padded = torch.cat([x_T_, x_T_.new_zeros((1, *x_T_.shape[1:]))])
    return padded.index_select(0, lay.token_S).view(lay.M, Q, *x_T_.shape[1:])


# ------------------------------------------------------------------ the gated delta rule


def gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    seq: SeqInfo,
) -> torch.Tensor:
    """The gated delta rule over each packed sequence (state zero at its start) -> (T, H, V)
    in v's dtype. q, k are normalised here (L2, and q * K^-0.5); g (log decay, <= 0) and beta
    as transformers computes them. Key heads shared by several value heads (Hk < H) come in
    repeated. When generating, `seq.kv` runs it with the cached state."""
    if seq.kv is not None:
        return seq.kv.recurrent.delta(q_THK, k_THK, v_THV, g_TH, beta_TH)
    if q_THK.is_cuda and fla_chunk_rule() is not None:
        return fla_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, seq)[0]
    return chunk_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, seq)[0]


def chunk_gated_delta(
    q_THK, k_THK, v_THV, g_TH, beta_TH, seq: SeqInfo, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch chunked form -> (o_THV in v's dtype, each sequence's final state
    (N, H, K, V) float32)."""
    Q, lay = chunk, chunk_layout(seq, chunk)
    T, H, K = q_THK.shape
    q, k, v, g, beta = (x.float() for x in (q_THK, k_THK, v_THV, g_TH, beta_TH))
    q, k = l2norm(q) * K**-0.5, l2norm(k)
    q, k, v = (_to_chunks(x, lay, Q).transpose(1, 2) for x in (q, k, v))  # (M, H, Q, .)
    g_MHQ, beta_MHQ = (_to_chunks(x, lay, Q).transpose(1, 2) for x in (g, beta))
    # Intra-chunk, batched over every chunk (transformers' torch_chunk_gated_delta_rule).
    k_beta, v_beta = k * beta_MHQ[..., None], v * beta_MHQ[..., None]
    cum_MHQ = g_MHQ.cumsum(-1)
    upper = torch.ones(Q, Q, dtype=torch.bool, device=q.device).triu(1)
    decay_MHQQ = (
        (cum_MHQ[..., :, None] - cum_MHQ[..., None, :]).masked_fill(upper, float("-inf")).exp()
    )
    ut_MHQQ = (k_beta @ k.transpose(-1, -2)) * decay_MHQQ
    intra_MHQQ = (q @ k.transpose(-1, -2)) * decay_MHQQ
    u_MHQV = torch.linalg.solve_triangular(ut_MHQQ, v_beta, upper=False, unitriangular=True)
    w_MHQK = torch.linalg.solve_triangular(
        ut_MHQQ, k_beta * cum_MHQ.exp()[..., None], upper=False, unitriangular=True
    )
    q_read = q * cum_MHQ.exp()[..., None]
    k_write = k * (cum_MHQ[..., -1:] - cum_MHQ).exp()[..., None]
    chunk_decay_MH11 = cum_MHQ[..., -1].exp()[..., None, None]
    # The scan over chunk steps: step j holds the j-th chunk of each of its n live sequences.
    V = v.shape[-1]
    S = q.new_zeros(lay.num_seqs, H, K, V)
    outs, finals = [], []
    for j, (c, n) in enumerate(lay.steps):
        sl = slice(c, c + n)
        S_n = S[:n]
        v_new = u_MHQV[sl] - w_MHQK[sl] @ S_n
        outs.append(q_read[sl] @ S_n + intra_MHQQ[sl] @ v_new)
        S = S_n * chunk_decay_MH11[sl] + k_write[sl].transpose(-1, -2) @ v_new
        n_next = lay.steps[j + 1][1] if j + 1 < len(lay.steps) else 0
        finals.append(S[n_next:])
    o_MHQV = torch.cat(outs)
    o_SHV = o_MHQV.transpose(1, 2).reshape(lay.M * Q, H, V)
    o_THV = o_SHV.index_select(0, lay.slot_T).to(v_THV.dtype)
    final_sorted = torch.cat(finals[::-1])  # sorted positions 0..N-1
    return o_THV, final_sorted.index_select(0, lay.unsort_N)


def delta_step(
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_BHKV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: -> (o_BHV in v's dtype, the new state (B, H, K, V) float32)."""
    K = q_BHK.shape[-1]
    q, k = l2norm(q_BHK.float()) * K**-0.5, l2norm(k_BHK.float())
    S = state_BHKV * g_BH.float().exp()[..., None, None]
    delta_BHV = (v_BHV.float() - (S * k[..., None]).sum(-2)) * beta_BH.float()[..., None]
    S = S + k[..., None] * delta_BHV[..., None, :]
    o_BHV = (S * q[..., None]).sum(-2)
    return o_BHV.to(v_BHV.dtype), S


# ------------------------------------------------------------------ fla on CUDA


@functools.cache
def fla_chunk_rule():
    """fla's `chunk_gated_delta_rule` when installed and it takes `cu_seqlens`, else None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no triton/CUDA to import it with
        return None
    params = inspect.signature(chunk_gated_delta_rule).parameters
    return chunk_gated_delta_rule if "cu_seqlens" in params else None


def fla_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, seq: SeqInfo, final: bool = False):
    """fla over the packed batch as one row with cu_seqlens -> (o_THV, (N, H, K, V) | None).
    Where fla takes `cu_seqlens_cpu` it gets the host copy, so its chunk indices are built
    without reading the device's cu_seqlens back (a sync per layer)."""
    rule = fla_chunk_rule()
    extra = {}
    if "cu_seqlens_cpu" in inspect.signature(rule).parameters:
        extra["cu_seqlens_cpu"] = seq.cached("cu_seqlens_cpu", lambda: _host_cu_seqlens(seq))
    o, state = rule(
        q_THK[None], k_THK[None], v_THV[None], g_TH[None].float(), beta_TH[None],
        initial_state=None, output_final_state=final, cu_seqlens=seq.cu_seqlens.long(),
        use_qk_l2norm_in_kernel=True, **extra,
    )  # fmt: skip
    return o[0].to(v_THV.dtype), state


def _host_cu_seqlens(seq: SeqInfo) -> torch.Tensor:
    ends = [0]
    for n in seq.lengths:
        ends.append(ends[-1] + n)
    return torch.tensor(ends, dtype=torch.int64)
