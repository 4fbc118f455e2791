"""The LM head on labelled positions only: `Batch.label_positions` from the collator, and
`model.loss(..., label_positions=...)` against the full computation.

Checks: hand-computed positions for a packed batch, in the one host buffer `Batch.to` copies;
loss and every gradient equal with and without positions for a dense model (untied, tied,
LoRA) and both MoE families, on both cross-entropy backends: float32, only the summation
order differs, `allclose(atol=1e-6, rtol=1e-6)` on the per-label loss (a summed loss and its
gradients divided by N, as the trainer does; largest difference seen 6.6e-7, torch backend,
qwen3_moe; the chunked backend gave identical gradients); zero host syncs for
forward+backward with positions (while a boolean-mask selection does sync); an all-masked
micro-batch (N=0) gives 0 loss and zero, finite gradients without a sync; the trainer and
the DDP wrapper pass the positions through.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.models import make_hf_model
from helpers.moe_models import make_hf_moe_model

import slipstream
from slipstream import distributed as dist
from slipstream.data import IGNORE_INDEX, Batch, Example, collate
from slipstream.debug import count_syncs
from slipstream.objectives.sft import SFT
from slipstream.ops import loss as loss_mod
from slipstream.peft.lora import apply_lora
from slipstream.train.loop import accumulate_gradients

BACKENDS = ["chunked"] + (["torch"] if loss_mod.USE_TORCH_LCE else [])
TOL = dict(atol=1e-6, rtol=1e-6)  # float32 rounding of sums taken in another order
VOCAB = 97


def chat_examples(lengths: list[int], seed: int, labelled: float = 0.38) -> list[Example]:
    """Examples whose trainable tokens form one 'assistant' span of ~`labelled` of each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        start = n - max(1, round(labelled * n))
        out.append(Example(ids, [t >= start for t in range(n)]))
    return out


def loss_and_grads(model, batch: Batch, positions, reduction: str):
    model.zero_grad(set_to_none=True)
    loss = model.loss(
        batch.input_ids, batch.labels, batch.seq, reduction=reduction, label_positions=positions
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(model, batch: Batch, reduction: str) -> None:
    loss_full, grads_full = loss_and_grads(model, batch, None, reduction)
    loss_sel, grads_sel = loss_and_grads(model, batch, batch.label_positions, reduction)
    per_label = batch.num_labels if reduction == "sum" else 1  # compare at the trained scale
    torch.testing.assert_close(loss_sel / per_label, loss_full / per_label, **TOL)
    assert grads_full and grads_sel.keys() == grads_full.keys()
    for name, grad in grads_full.items():
        got, want = grads_sel[name] / per_label, grad / per_label
        assert torch.allclose(got, want, **TOL), (name, (got - want).abs().max())


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    make_hf_model("llama", initializer_range=0.2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    make_hf_model("qwen3", tie_word_embeddings=True, initializer_range=0.2).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_moe_model(request.param).save_pretrained(path)
    return path


def test_collate_builds_positions_for_a_packed_batch():
    a = Example([10, 11, 12, 13], [False, False, True, True])
    b = Example([20, 21, 22], [True, True, True])  # a trainable first token has no source
    c = Example([30, 31], [False, False])
    batch = collate([a, b, c])
    X = IGNORE_INDEX
    assert batch.labels.tolist() == [X, 12, 13, X, 21, 22, X, X, X]
    assert batch.label_positions.tolist() == [1, 2, 4, 5]  # t with labels[t] != -100
    assert batch.label_positions.dtype == torch.int64 and batch.num_labels == 4
    # One host buffer [input_ids | labels | positions]: Batch.to copies it once.
    host = batch._host
    assert host.tolist() == batch.input_ids.tolist() + batch.labels.tolist() + [1, 2, 4, 5]
    for view, offset in ((batch.input_ids, 0), (batch.labels, 9), (batch.label_positions, 18)):
        assert view.data_ptr() == host.data_ptr() + 8 * offset
    moved = batch.to("cpu")
    assert moved.label_positions.tolist() == [1, 2, 4, 5] and moved.num_labels == 4
    assert moved.label_positions.data_ptr() == moved.input_ids.data_ptr() + 8 * 18


def test_hand_built_batch_moves_with_or_without_positions():
    ids, labels = torch.arange(5), torch.tensor([1, 2, -100, 4, -100])
    seq = slipstream.SeqInfo.from_lengths([5])
    plain = Batch(ids, labels, seq, 2).to("cpu")
    assert plain.label_positions is None and plain.labels.tolist() == labels.tolist()
    given = Batch(ids, labels, seq, 2, torch.tensor([0, 1, 3])).to("cpu")
    assert given.label_positions.tolist() == [0, 1, 3] and given.input_ids.tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dense_loss_and_grads_equal(dense_dir, tied_dir, backend, reduction, monkeypatch):
    monkeypatch.setattr(loss_mod, "USE_TORCH_LCE", backend == "torch")
    batch = collate(chat_examples([9, 14, 6, 11], seed=1))
    assert 0 < batch.num_labels < batch.num_tokens / 2
    for path in (dense_dir, tied_dir):
        model = slipstream.load_model(path).requires_grad_(True)
        assert_same(model, batch, reduction)


def test_lora_grads_equal(dense_dir):
    model = apply_lora(slipstream.load_model(dense_dir), rank=4, alpha=8, targets="all-linear")
    with torch.no_grad():  # B starts at 0; make A's gradient non-zero too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert_same(model, collate(chat_examples([12, 7, 10], seed=2)), "sum")


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_loss_and_grads_equal(moe_dir, backend, monkeypatch):
    monkeypatch.setattr(loss_mod, "USE_TORCH_LCE", backend == "torch")
    model = slipstream.load_model(moe_dir).requires_grad_(True)
    batch = collate(chat_examples([13, 5, 9, 8], seed=3))
    for reduction in ("mean", "sum"):
        assert_same(model, batch, reduction)


def test_no_host_sync_with_positions(dense_dir, moe_dir):
    batch = collate(chat_examples([15, 8, 12], seed=4)).to("cpu")
    for path in (dense_dir, moe_dir):
        model = slipstream.load_model(path).requires_grad_(True)
        args = (batch.input_ids, batch.labels, batch.seq)
        model.loss(*args, label_positions=batch.label_positions).backward()  # warm-up
        with count_syncs() as syncs:
            model.loss(*args, label_positions=batch.label_positions).backward()
        assert syncs.total == 0, str(syncs)
    # The audit can fail: selecting the rows with a boolean mask is a sync.
    h_TD = torch.randn(batch.num_tokens, 4)
    with count_syncs() as masked:
        h_TD[batch.labels != IGNORE_INDEX]
    assert masked.total > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_micro_batch(dense_dir, backend, monkeypatch):
    monkeypatch.setattr(loss_mod, "USE_TORCH_LCE", backend == "torch")
    model = slipstream.load_model(dense_dir).requires_grad_(True)
    examples = [Example([1, 2, 3, 4], [False] * 4), Example([5, 6, 7], [True, False, False])]
    batch = collate(examples)
    assert batch.num_labels == 0 and batch.label_positions.shape == (0,)
    for reduction in ("mean", "sum"):
        model.zero_grad(set_to_none=True)
        with count_syncs() as syncs:
            loss = model.loss(
                batch.input_ids, batch.labels, batch.seq, reduction, batch.label_positions
            )
            loss.backward()
        assert syncs.total == 0, str(syncs)
        assert loss.item() == 0.0
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() and not g.any() for g in grads)


def test_trainer_passes_positions(dense_dir):
    model = slipstream.load_model(dense_dir).requires_grad_(True)
    window = [collate(chat_examples(lens, seed=s)) for s, lens in enumerate([[9, 7], [12, 5]])]
    seen = []
    real_loss = model.loss

    def spy(*args, **kwargs):
        seen.append(kwargs.get("label_positions"))
        return real_loss(*args, **kwargs)

    model.loss = spy
    total, _ = accumulate_gradients(model, window, SFT())
    assert [p is b.label_positions for p, b in zip(seen, window)] == [True, True]
    grads = [p.grad.clone() for p in model.parameters()]
    # Batches without positions (built by hand) take the full path: same loss and grads.
    model.zero_grad(set_to_none=True)
    plain = [SimpleNamespace(**{**vars(b), "label_positions": None}) for b in window]
    torch.testing.assert_close(accumulate_gradients(model, plain, SFT())[0], total, **TOL)
    for got, want in zip([p.grad for p in model.parameters()], grads):
        torch.testing.assert_close(got, want, **TOL)


def test_ddp_wrapper_passes_positions(dense_dir):
    """One-process gloo DDP: the objective's loss run through the DDP wrapper equals the
    model's own (positions that leave out a labelled row change it, so the batch's positions
    do reach the model), and the gradients it leaves equal those of the plain call."""
    import dataclasses

    tdist = torch.distributed
    model = slipstream.load_model(dense_dir).requires_grad_(True)
    batch = collate(chat_examples([10, 9], seed=5))
    dropped = dataclasses.replace(batch, label_positions=batch.label_positions[1:], _host=None)
    sft = SFT()
    want = [sft.micro_batch_loss(model, b)[0] for b in (batch, dropped)]
    assert not torch.allclose(want[0], want[1])
    want[0].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        ddp = dist.wrap_model(model, "ddp", torch.device("cpu"))
        assert "loss" not in vars(model)  # the model keeps its own method
        got = []
        for b in (batch, dropped):
            loss, _ = dist.run_through(ddp, sft.micro_batch_loss, model, b)
            loss.backward()  # DDP wants a backward before the next forward
            got.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
    finally:
        tdist.destroy_process_group()
    torch.testing.assert_close(got[0][0], want[0].detach(), **TOL)
    torch.testing.assert_close(got[1][0], want[1].detach(), **TOL)
    for g, w in zip(got[0][1], grads):
        torch.testing.assert_close(g, w, **TOL)


def test_bad_positions_are_a_clear_error(dense_dir):
    model = slipstream.load_model(dense_dir)
    batch = collate(chat_examples([6], seed=6))
    args = (batch.input_ids, batch.labels, batch.seq)
    with pytest.raises(ValueError, match="label_positions has shape"):
        model.loss(*args, label_positions=batch.label_positions[None])
    with pytest.raises(ValueError, match="label_positions has shape"):
        model.loss(*args, label_positions=batch.label_positions.float())
