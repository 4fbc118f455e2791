"""Best-fit-decreasing packing and the collator's within-sequence label shift."""

import random

import pytest
import torch
from helpers.tokenizers import save_test_tokenizer
from transformers import AutoTokenizer

from slipstream.data import (
    IGNORE_INDEX,
    Example,
    chitchat_rows,
    collate,
    epoch_order,
    pack_examples,
    packing_efficiency,
    tokenize_rows,
)


def test_bfd_respects_budget_and_places_every_example_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    batches = pack_examples(lengths, 512)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 512 for b in batches)
    assert pack_examples(lengths, 512) == batches  # deterministic
    # Best fit: no two batches could be merged into one.
    loads = sorted(sum(lengths[i] for i in b) for b in batches)
    assert loads[0] + loads[1] > 512
    assert packing_efficiency(lengths, batches, 512) == sum(lengths) / (len(batches) * 512)


def test_bfd_exact_small_case():
    # Decreasing order 6,5,4,3,2: 6 -> A, 5 -> B, 4 -> A (room 4 is the tightest), 3 -> B, 2 -> B.
    assert pack_examples([3, 6, 2, 5, 4], 10) == [[1, 4], [3, 0, 2]]


def test_over_budget_example_is_a_user_error():
    with pytest.raises(ValueError, match="example 1 has 900 tokens, over tokens_per_batch = 512"):
        pack_examples([10, 900, 20], 512)


def test_epoch_order_is_seeded_and_changes_per_epoch():
    a0, a1 = epoch_order(50, seed=1, epoch=0), epoch_order(50, seed=1, epoch=1)
    assert sorted(a0) == list(range(50)) and a0 != a1
    assert a0 == epoch_order(50, seed=1, epoch=0) and a0 != epoch_order(50, seed=2, epoch=0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(
        save_test_tokenizer(tmp_path_factory.mktemp("t"), "chatml")
    )


@pytest.fixture(scope="module")
def chitchat_lengths(tokenizer):
    # train_on="all" renders each conversation once (lengths do not depend on the mask).
    rows = chitchat_rows(3000, max_turns=8)
    examples, _ = tokenize_rows(rows, tokenizer, max_tokens=2048, train_on="all")
    return [len(e) for e in examples]


@pytest.mark.parametrize("budget", [2048, 4096, 8192])
def test_chitchat_packs_at_least_98_percent(chitchat_lengths, budget):
    lengths = chitchat_lengths
    batches = pack_examples(lengths, budget)
    assert all(sum(lengths[i] for i in b) <= budget for b in batches)
    assert packing_efficiency(lengths, batches, budget) >= 0.98


def test_collate_shifts_labels_within_each_sequence():
    a = Example([10, 11, 12, 13], [False, False, True, True])
    b = Example([20, 21, 22], [False, True, True])
    c = Example([30, 31], [False, False])
    batch = collate([a, b, c])
    assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22, 30, 31]
    X = IGNORE_INDEX
    # Position 3 (last of a) must not predict 20 (first of b), though 20 is the next token.
    assert batch.labels.tolist() == [X, 12, 13, X, 21, 22, X, X, X]
    assert batch.num_labels == 4
    assert batch.seq.lengths == (4, 3, 2)
    assert batch.seq.cu_seqlens.tolist() == [0, 4, 7, 9]
    assert batch.seq.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    moved = batch.to("cpu")
    assert torch.equal(moved.labels, batch.labels) and moved.num_labels == 4


def test_collate_never_labels_across_boundaries(tokenizer):
    examples, _ = tokenize_rows(chitchat_rows(40, max_turns=6), tokenizer, max_tokens=2048)
    batch = collate(examples)
    ends = batch.seq.cu_seqlens[1:].tolist()
    assert all(batch.labels[e - 1].item() == IGNORE_INDEX for e in ends)
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    for t, y in enumerate(labels):
        if y != IGNORE_INDEX:
            assert y == ids[t + 1] and (t + 1) not in ends[:-1]
    assert batch.num_labels == sum(sum(e.trainable[1:]) for e in examples)


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="no examples"):
        collate([])
    with pytest.raises(ValueError, match="3 ids but 2 mask"):
        collate([Example([1, 2, 3], [True, True])])
