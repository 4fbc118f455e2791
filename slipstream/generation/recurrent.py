"""Generation state of recurrent token mixers (Gated DeltaNet), beside the KV cache.

Per recurrent layer l and cache row b: `conv[l][b]` (C, J), the last J = W - 1 inputs of the
causal conv (zeros before the prompt's start), and `rec[l][b]` (H, K, V) float32, the delta
rule's state. A layer is reached by `ops.gated_delta.causal_conv` (-> `conv`, which moves to
the next layer) then `gated_delta_rule` (-> `delta`, same layer); the step counts them as
`attend` is counted and `finish` checks every layer was reached once.

Prefill: the packed training path (conv restarting per sequence, the chunked rule) on the
prompts; each prompt's last J inputs and final state land in its cache row by host-built
indices. Decode: one token per row, `conv_step` and `delta_step`. Rows are compacted with the
keys and values (`keep_rows`).

Shapes: T packed prompt tokens, N prompts, B rows, C conv channels, J conv history,
H value heads, K key head dim, V value head dim.
"""

from __future__ import annotations

import torch

from slipstream.ops.gated_delta import (
    chunk_gated_delta,
    conv_packed,
    conv_step,
    conv_tail_index,
    delta_step,
    fla_chunk_rule,
    fla_gated_delta,
)
from slipstream.ops.packing import SeqInfo


class RecurrentState:
    """conv[l] (B, C, J) in the activation dtype and rec[l] (B, H, K, V) float32 per layer."""

    def __init__(self, rows: int, shapes, dtype: torch.dtype, device: torch.device) -> None:
        self.conv = [torch.zeros(rows, *c, dtype=dtype, device=device) for c, _ in shapes]
        self.rec = [torch.zeros(rows, *r, dtype=torch.float32, device=device) for _, r in shapes]

    def keep_rows(self, rows_B: torch.Tensor) -> None:
        self.conv = [c.index_select(0, rows_B) for c in self.conv]
        self.rec = [r.index_select(0, rows_B) for r in self.rec]


class _RecurrentStep:
    def __init__(self, state: RecurrentState) -> None:
        self.state, self.layer = state, -1

    def next_layer(self) -> int:
        self.layer += 1
        return self.layer

    def finish(self) -> None:
        assert self.layer + 1 == len(self.state.conv), (
            f"generation cache: the forward reached {self.layer + 1} recurrent layers of "
            f"{len(self.state.conv)} (each must run its conv and delta rule once)"
        )


class RecurrentPrefill(_RecurrentStep):
    """Prompts packed as one SeqInfo; prompt i's state goes to cache row rows_N[i]."""

    def __init__(self, state: RecurrentState, seq: SeqInfo, rows_N: torch.Tensor) -> None:
        super().__init__(state)
        self.seq, self.rows_N = seq, rows_N

    def conv(self, x_TC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        l, J = self.next_layer(), weight_CW.shape[1] - 1
        padded = torch.cat([x_TC, x_TC.new_zeros(1, x_TC.shape[1])])
        tail_NJC = padded[conv_tail_index(self.seq, J)]
        self.state.conv[l][self.rows_N] = tail_NJC.transpose(1, 2).to(self.state.conv[l].dtype)
        return conv_packed(x_TC, weight_CW, self.seq)

    def delta(self, q_THK, k_THK, v_THV, g_TH, beta_TH) -> torch.Tensor:
        if q_THK.is_cuda and fla_chunk_rule() is not None:
            o_THV, final = fla_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, self.seq, final=True)
        else:
            o_THV, final = chunk_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, self.seq)
        self.state.rec[self.layer][self.rows_N] = final.float()
        return o_THV


class RecurrentDecode(_RecurrentStep):
    """One token per cache row."""

    def conv(self, x_BC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        l = self.next_layer()
        y_BC, self.state.conv[l] = conv_step(x_BC, self.state.conv[l], weight_CW)
        return y_BC

    def delta(self, q_BHK, k_BHK, v_BHV, g_BH, beta_BH) -> torch.Tensor:
        l = self.layer
        o_BHV, self.state.rec[l] = delta_step(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, self.state.rec[l])
        return o_BHV
