"""Greedy decoding for quick looks at a model (the demo's before/after replies).

Not a serving path: no KV cache, each new token re-runs the whole sequence, which is fine
for a few dozen tokens on a small model (SmolLM2-135M: ~30 ms a step at 100 tokens on 2
CPU cores). Reading each chosen token back to the host is a sync by nature here.
"""

from __future__ import annotations

import torch

from slipstream.models.common import CausalLM
from slipstream.ops.packing import SeqInfo


@torch.no_grad()
def greedy_generate(
    model: CausalLM, prompt_ids: list[int], max_new_tokens: int = 40, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """Token ids generated after `prompt_ids`, stopping at any of `stop_ids` (not included)."""
    if not prompt_ids:
        raise ValueError("greedy_generate: prompt_ids is empty; give at least one token.")
    device = model.lm_head_weight().device
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor(ids, device=device)
        h_TD = model.hidden_states(x, SeqInfo.from_lengths([len(ids)], device))
        next_id = int(torch.argmax(h_TD[-1] @ model.lm_head_weight().T))
        if next_id in stop_ids:
            break
        new.append(next_id)
        ids.append(next_id)
    return new
