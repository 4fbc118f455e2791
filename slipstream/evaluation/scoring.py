"""Log-likelihood requests as packed forwards: `score(model, requests, ...)`.

A request is (context token ids, continuation token ids); its answer is the continuation's
summed log-prob given the context, and whether greedy decoding would have produced it
(every continuation token is its position's argmax). lm-eval's `loglikelihood` and
`loglikelihood_rolling` both reduce to these (evaluation/lm.py).

- Window: HFLM's. The model sees `(context + continuation)[-(max_length + 1):][:-1]` and the
  last `len(continuation)` positions are scored, so a context longer than the model's window
  loses its oldest tokens, as lm-eval's HFLM truncates it.
- Requests whose input is the same token sequence (lm-eval asks one per choice of a
  multiple-choice question, and a one-token answer leaves the input the same) run once.
- Sequences are packed best-fit decreasing into batches of `tokens_per_batch` tokens (no
  padding: HFLM pads each batch to its longest row); only the scored positions go through
  the LM head, in chunks of at most 2**25 float32 logits.
- Each batch is one host buffer (`data.packed.PackedBuilder`: ids, scored positions,
  targets, request slots) copied once, and one host read of its requests' sums and greedy
  misses.

Shapes: T tokens in a batch, N scored positions, R requests in the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slipstream.data.packed import PackedBuilder
from slipstream.data.packing import pack_examples

# Scored rows per LM-head chunk: 2**25 float32 logits (128 MB, and as much for their
# log-softmax) at most.
CHUNK_LOGITS = 1 << 25

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
Head = Callable[[torch.Tensor], torch.Tensor]  # h_ND -> logits_NV


def window(context: Sequence[int], continuation: Sequence[int], max_length: int):
    """(model input ids as a tuple, scored positions at its end) of one request, as HFLM."""
    if not continuation:
        raise ValueError("a loglikelihood request has an empty continuation; nothing to score")
    if len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens is longer than the model's window "
            f"({max_length} tokens); lm-eval cannot score it"
        )
    whole = [*context, *continuation][-(max_length + 1) :]
    if len(whole) < 2:
        raise ValueError("a loglikelihood request needs a context token before its continuation")
    return tuple(whole[:-1]), len(continuation)


@dataclass
class Plan:
    """The distinct input sequences, and for each request (its sequence, its targets)."""

    sequences: list[tuple[int, ...]]
    requests: list[tuple[int, tuple[int, ...]]]
    batches: list[list[int]]  # sequence indices a batch

    @classmethod
    def build(cls, requests: Sequence[Request], max_length: int, tokens_per_batch: int) -> Plan:
        index: dict[tuple[int, ...], int] = {}
        sequences, per_request = [], []
        for context, continuation in requests:
            ids, _ = window(context, continuation, max_length)
            k = index.setdefault(ids, len(sequences))
            if k == len(sequences):
                sequences.append(ids)
            per_request.append((k, tuple(continuation)))
        lengths = [len(s) for s in sequences]
        budget = max([tokens_per_batch, *lengths])  # a window longer than the budget: alone
        return cls(sequences, per_request, pack_examples(lengths, budget) if lengths else [])


@torch.no_grad()
def score(
    model,
    requests: Sequence[Request],
    *,
    max_length: int,
    tokens_per_batch: int = 8192,
    head: Head | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """(summed log-prob of the continuation, greedy) for each request, in order.

    `head`: the LM head as a function (default `F.linear` on `model.lm_head_weight()`);
    `on_batch(n)` is called after each batch with the number of requests it answered."""
    plan = Plan.build(requests, max_length, tokens_per_batch)
    weight = model.lm_head_weight()
    raw_head = head or (lambda h: torch.nn.functional.linear(h, weight))

    def head(h_ND: torch.Tensor) -> torch.Tensor:  # the model's logits: scaling, softcap
        return model.finish_logits(raw_head(h_ND))

    device = weight.device
    by_sequence: dict[int, list[int]] = {}
    for r, (k, _) in enumerate(plan.requests):
        by_sequence.setdefault(k, []).append(r)
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for batch in plan.batches:
            slots = [r for k in batch for r in by_sequence[k]]
            sums = _score_batch(model, head, plan, batch, by_sequence, device)
            for slot, (logprob, misses) in zip(slots, sums, strict=True):
                out[slot] = (logprob, misses == 0)
            if on_batch is not None:
                on_batch(len(slots))
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


def _score_batch(model, head: Head, plan: Plan, batch: list[int], by_sequence, device):
    """One packed forward of the batch's sequences -> [(log-prob sum, greedy misses)] for
    each request of the batch, in `by_sequence` order (the one host read)."""
    builder = PackedBuilder()  # the sequences, unscored: what is scored rides as fields
    positions: list[int] = []
    targets: list[int] = []
    slots: list[int] = []  # each scored position's request, 0..R-1 within the batch
    R = 0
    for k in batch:
        start, seq = len(builder.ids), plan.sequences[k]
        builder.add(seq, [])
        for r in by_sequence[k]:
            cont = plan.requests[r][1]
            first = start + len(seq) - len(cont)
            positions.extend(range(first, first + len(cont)))
            targets.extend(cont)
            slots.extend([R] * len(cont))
            R += 1
    for name, values in (("positions", positions), ("targets", targets), ("slots", slots)):
        builder.put(name, torch.tensor(values, dtype=torch.int64))
    packed = builder.build().to(device)
    f = packed.fields
    h_TD = model.hidden_states(packed.input_ids, packed.seq)
    pos_N, tgt_N, slot_N = f["positions"], f["targets"], f["slots"]
    vocab = model.lm_head_weight().shape[0]
    logp_N, hit_N = token_logps_and_hits(h_TD.index_select(0, pos_N), tgt_N, head, vocab)
    sums_2R = torch.zeros(2, R, dtype=torch.float32, device=device)
    sums_2R[0].index_add_(0, slot_N, logp_N)
    sums_2R[1].index_add_(0, slot_N, (~hit_N).float())
    return list(zip(*sums_2R.tolist(), strict=True))


def token_logps_and_hits(h_ND: torch.Tensor, targets_N: torch.Tensor, head: Head, vocab: int):
    """(log softmax(head(h))[n, target_n] (N,) float32, whether target_n is the argmax (N,)
    bool); the head runs on chunks of rows, at most CHUNK_LOGITS logits at once."""
    rows = max(1, CHUNK_LOGITS // vocab)
    logps, hits = [], []
    for h_CD, y_C in zip(h_ND.split(rows), targets_N.split(rows), strict=True):
        # log_softmax, as HFLM: `gather - logsumexp` rounds (max + log-sum) first and came out
        # 8e-6 a token lower on SmolLM2, -3.4e-4 over a 43-token document.
        logp_CV = head(h_CD).float().log_softmax(-1)
        logps.append(logp_CV.gather(1, y_C[:, None]).squeeze(1))
        hits.append(logp_CV.argmax(-1) == y_C)
    return torch.cat(logps), torch.cat(hits)
