"""The generation loop: packed prefill, batched decode, a stop check every few tokens.

1. Prefill: the distinct prompts go through the model as one packed batch (`SeqInfo`); their
   keys and values land in the KV cache and only each prompt's last position goes through
   the LM head. With n samples a prompt, the prompt is prefilled once and its cache rows
   repeated.
2. Decode: every live row feeds its last token at its own position; one forward for all.
   Tokens and log-probs collect in a small device buffer.
3. Every `check_every` tokens, one host sync reads that buffer back (tokens and log-probs in
   one int32 tensor): rows that met a stop token, a stop string or their length limit
   finish, and the cache, positions and buffers keep only the live rows, so finished rows
   stop costing work. Between checks a finished row runs on for at most check_every - 1
   tokens, which are dropped.

On CPU in float32 the linear layers and the LM head run on weights packed once per call
(generation/packed_linear.py): the GEMM does not repack every weight at every token.

Phi-3 longrope (`Backbone.rope_switch_length`): a row whose length reaches
original_max_position_embeddings + 1 is prefilled again in full at that step, every position
under the long factors, as transformers' generate recomputes its cache there (`_recompute`).

Host syncs: one per check, so ceil(max_new_tokens / check_every) for a batch that runs to
its length limit (32 at 256 tokens with the default of 8), fewer when rows stop early;
measured by tests/test_generation.py with `count_syncs`.

Shapes: B live rows, V vocabulary, K = check_every.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import slipstream.generation.hf_engine as hf_engine
from slipstream.generation.cache import Decode, KVCache, Prefill, decode_seq
from slipstream.generation.images import HOST_KEYS, OFFSETS_KEY, PROMPTS_KEY, SPANS_KEY
from slipstream.generation.packed_linear import packed_linears
from slipstream.generation.sampling import Sampling, sample
from slipstream.ops.packing import SeqInfo

CHECK_EVERY = 8


@dataclass
class Row:
    """One sequence being generated (host state)."""

    prompt_index: int
    prompt_len: int
    limit: int  # most tokens it may generate
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


# (row, first new token index) -> number of tokens to keep if a stop string ended the row.
StopFinder = Callable[[Row, int], "int | None"]


@torch.no_grad()
def run(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    samples_per_prompt: int = 1,
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    find_stop: StopFinder | None = None,
    max_positions: int | None = None,
    generator: torch.Generator | None = None,
    check_every: int = CHECK_EVERY,
    on_check: Callable[[list[Row]], None] | None = None,
    logprobs: bool = True,
    images: dict | None = None,
) -> list[Row]:
    """Generate for each prompt `samples_per_prompt` times -> rows, prompt-major.

    `on_check(rows)` is called after each stop check (streaming). `max_positions` caps
    prompt + generated tokens (the model's context). `logprobs=False` skips computing them
    (the rows' `logprobs` are then zeros). `images`: the packed image inputs of the prompts
    (generation/images.py), written into their rows at the prefill."""
    n = samples_per_prompt
    rows = []
    for i, p in enumerate(prompts):
        room = max_new_tokens if max_positions is None else max_positions - len(p)
        rows += [Row(i, len(p), min(max_new_tokens, room)) for _ in range(n)]
    hf_engine.say_engine(model)
    if hf_engine.transformers_reason(model):  # layers or attention our KV cache cannot run
        return hf_engine.run(
            model, prompts, rows, check=_check, sampling=sampling, stop_ids=stop_ids,
            find_stop=find_stop, generator=generator, check_every=check_every,
            on_check=on_check, logprobs=logprobs,
            images=(images or {}).get(PROMPTS_KEY),
        )  # fmt: skip
    was_training = model.training
    model.eval()
    try:
        with packed_linears(model, model.lm_head_weight(), len(rows)) as raw_head:

            def lm_head(h_BD: torch.Tensor) -> torch.Tensor:  # with scaling / final softcap
                return model.finish_logits(raw_head(h_BD))

            return _run(model, lm_head, prompts, rows, n, sampling, set(stop_ids), find_stop,
                        generator, check_every, on_check, logprobs, images)  # fmt: skip
    finally:
        model.train(was_training)


def _run(model, lm_head, prompts, rows, n, sampling, stop_ids, find_stop, generator, K, on_check,
         want_lp, images=None):  # fmt: skip
    device = model.input_embeddings().weight.device
    steps = max(r.limit for r in rows)
    cache = KVCache.for_model(model, len(prompts), max(map(len, prompts)) + steps)
    logits_BV = _prefill(model, cache, prompts, lm_head, device, images)
    if n > 1:
        repeat = torch.arange(len(prompts), device=device).repeat_interleave(n)
        cache.keep_rows(repeat)
        logits_BV = logits_BV.index_select(0, repeat)
    live = list(rows)
    pos_B = torch.tensor([r.prompt_len for r in live]).to(device, non_blocking=True)
    offsets = (images or {}).get(OFFSETS_KEY)  # Qwen-VL: rotary position - cache position
    off_B = None
    if offsets is not None:
        off_B = torch.tensor([offsets[r.prompt_index] for r in live]).to(device, non_blocking=True)
    buf_BK2 = torch.zeros(len(live), K, 2, dtype=torch.int32, device=device)
    switch = model.rope_switch_length  # None for every family but Phi-3 longrope
    gen_BS = torch.zeros(len(live), steps, dtype=torch.long, device=device) if switch else None
    for step in range(steps):
        token_B, logprob_B = sample(logits_BV, sampling, generator, logprobs=want_lp)
        buf_BK2[:, step % K, 0] = token_B.to(torch.int32)
        if gen_BS is not None:
            gen_BS[:, step] = token_B
        if logprob_B is not None:
            buf_BK2[:, step % K, 1] = logprob_B.view(torch.int32)  # the float's bits, exact
        if (step + 1) % K == 0 or step + 1 == steps:
            keep = _check(live, buf_BK2[:, : step % K + 1], stop_ids, find_stop)
            if on_check is not None:
                on_check(rows)
            if not keep:
                break
            if len(keep) < len(live):  # compact: finished rows stop costing work
                live = [live[i] for i in keep]
                keep_B = torch.tensor(keep).to(device, non_blocking=True)
                cache.keep_rows(keep_B)
                pos_B, token_B = pos_B.index_select(0, keep_B), token_B.index_select(0, keep_B)
                off_B = off_B.index_select(0, keep_B) if off_B is not None else None
                buf_BK2 = buf_BK2.index_select(0, keep_B)
                gen_BS = gen_BS.index_select(0, keep_B) if gen_BS is not None else None
        if step + 1 == steps:
            break
        prompt_lens = [r.prompt_len for r in live]
        step_kv = Decode(cache, pos_B, min(prompt_lens) + step, max(prompt_lens) + step)
        seq = decode_seq(pos_B, step_kv)
        if off_B is not None:  # the rotary positions; the cache is still written at pos_B
            seq.position_ids = pos_B + off_B
        h_BD = model.hidden_states(token_B, seq)
        step_kv.finish()
        logits_BV = lm_head(h_BD)
        if switch is not None:
            crossing = [i for i, r in enumerate(live) if r.prompt_len + step + 1 == switch]
            if crossing:
                logits_BV = _recompute(model, cache, prompts, live, crossing, gen_BS[:, : step + 1],
                                       logits_BV, lm_head)  # fmt: skip
        pos_B = pos_B + 1
    for r in rows:
        r.finish_reason = r.finish_reason or "length"
    return rows


def _prefill(model, cache: KVCache, prompts, lm_head, device, images=None) -> torch.Tensor:
    """Packed forward of the prompts into the cache -> logits (N, V) at each prompt's end
    (`images`: their image inputs, features written into their rows)."""
    seq = SeqInfo.from_lengths([len(p) for p in prompts], device)
    step_kv = Prefill(cache, seq, list(range(len(prompts))))
    seq.kv = step_kv
    ids_T = torch.tensor([t for p in prompts for t in p]).to(device, non_blocking=True)
    if images is None:
        h_TD = model.hidden_states(ids_T, seq)
    else:
        seq.image_spans = images.get(SPANS_KEY, ())  # host ints (Gemma 3's images)
        # Tensors in one non-blocking copy each; SeqInfos (Qwen-VL's tower) by their own.
        images = {k: v.to(device) if isinstance(v, SeqInfo) else v.to(device, non_blocking=True)
                  for k, v in images.items() if k not in HOST_KEYS}  # fmt: skip
        h_TD = model.hidden_states(ids_T, seq, images=images)
    step_kv.finish()
    last_N = seq.cu_seqlens[1:].long() - 1
    return lm_head(h_TD.index_select(0, last_N))


def _recompute(model, cache: KVCache, prompts, live, crossing, gen_BJ, logits_BV, lm_head):
    """Rows whose length just reached `rope_switch_length` (Phi-3 longrope past
    original_max_position_embeddings): their whole sequence (prompt + J generated tokens)
    again as a prefill into their cache rows, every position now under the new RoPE tables,
    as transformers' generate does by dropping its cache there -> logits with those rows'
    replaced. The decode step's result for them is discarded (one row-token of waste)."""
    device = logits_BV.device
    parts = []
    for i in crossing:
        parts += [torch.tensor(prompts[live[i].prompt_index]).to(device, non_blocking=True),
                  gen_BJ[i]]  # fmt: skip
    seq = SeqInfo.from_lengths([p.numel() + gen_BJ.shape[1] for p in parts[::2]], device)
    step_kv = Prefill(cache, seq, crossing)
    seq.kv = step_kv
    h_TD = model.hidden_states(torch.cat(parts), seq)
    step_kv.finish()
    last_N = seq.cu_seqlens[1:].long() - 1
    fresh_NV = lm_head(h_TD.index_select(0, last_N))
    rows_N = torch.tensor(crossing).to(device, non_blocking=True)
    return logits_BV.index_copy(0, rows_N, fresh_NV)


def _check(live: list[Row], buf_BJ2: torch.Tensor, stop_ids, find_stop) -> list[int]:
    """Read the last J tokens of every live row (the one host sync) and finish rows that
    stopped -> indices of the rows still live."""
    keep = []
    for i, (r, pairs) in enumerate(zip(live, buf_BJ2.tolist(), strict=True)):
        tokens, bits = zip(*pairs, strict=True)
        logprobs = array("f", array("i", bits).tobytes())  # the int32 bits back to float32
        start = len(r.token_ids)
        for t, lp in zip(tokens, logprobs, strict=True):
            if len(r.token_ids) == r.limit:
                break
            r.token_ids.append(t)
            r.logprobs.append(lp)
            if t in stop_ids:
                r.finish_reason = "stop"
                break
        end = find_stop(r, start) if find_stop is not None else None
        if end is not None:
            del r.token_ids[end:], r.logprobs[end:]
            r.finish_reason = "stop"
        if r.finish_reason is None and len(r.token_ids) < r.limit:
            keep.append(i)
        elif r.finish_reason is None:
            r.finish_reason = "length"
    return keep
