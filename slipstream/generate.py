"""Greedy decoding for quick looks at a model: the demo's before/after replies and
`slipstream generate`.

Not a serving path: no KV cache, each new token re-runs the whole sequence, which is fine
for a few dozen tokens on a small model (SmolLM2-135M: ~30 ms a step at 100 tokens on 2
CPU cores). Reading each chosen token back to the host is a sync by nature here.
"""

from __future__ import annotations

from typing import Any

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


# End-of-turn tokens of common chat templates (ChatML/Qwen/SmolLM2, Llama 3, Phi-3, Gemma,
# GPT-OSS harmony): a reply stops at whichever of them the vocabulary has, or at eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|return|>")


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """eos, pad and the END_OF_TURN tokens that `tokenizer` knows."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return tuple(sorted(i for i in ids if i is not None))


def chat_reply(model: CausalLM, tokenizer: Any, prompt: str, max_new_tokens: int = 64) -> str:
    """The model's greedy reply to one user message, through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    was_training = model.training
    model.eval()
    try:
        reply = greedy_generate(model, list(ids), max_new_tokens, stop_token_ids(tokenizer))
    finally:
        model.train(was_training)
    return tokenizer.decode(reply, skip_special_tokens=True).strip()
