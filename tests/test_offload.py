"""Activation checkpointing and offload: identical numerics, the reload schedule, no syncs.

CPU runs force the offload schedule (`force=True`): the pool's bookkeeping and ordering are
the same code as on CUDA, with synchronous copies.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from helpers.models import make_hf_model

import slipstream
from slipstream.debug import count_syncs
from slipstream.memory import pool as pool_impl
from slipstream.memory.offload import OffloadPool, apply_checkpointing, get_offload_pool
from slipstream.ops.packing import SeqInfo

LAYERS = 8
LENGTHS = [7, 3, 12, 1]
OFFLOAD = dict(force=True, min_offload_bytes=0, record_events=True)
MODES = {
    "recompute": ("recompute", {}),
    "offload-double": ("offload", OFFLOAD),
    "offload-single": ("offload", {**OFFLOAD, "double_buffer": False}),
}


def _save(tmp_path_factory, family):
    path = tmp_path_factory.mktemp(family)
    make_hf_model(family, num_hidden_layers=LAYERS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return _save(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def cuda_dir(tmp_path_factory):
    """Head dim 16 (64 / 4): float32 on CUDA takes the flex path, whose kernel needs >= 16."""
    path = tmp_path_factory.mktemp("llama_cuda")
    make_hf_model(
        "llama", num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(path)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return _save(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers.moe_models import make_hf_moe_model

    path = tmp_path_factory.mktemp("qwen3_moe")
    make_hf_moe_model("qwen3_moe", num_hidden_layers=3).save_pretrained(path)
    return path


def _batch(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (sum(lengths),), generator=g)
    return ids, torch.randint(0, 97, ids.shape, generator=g), SeqInfo.from_lengths(lengths)


def _model(path, lora_dropout: float | None = None):
    model = slipstream.load_model(path)
    if lora_dropout is None:
        model.requires_grad_(True)
        return model
    from slipstream.peft.lora import apply_lora, lora_modules

    torch.manual_seed(3)  # lora_A's init draws from the global RNG
    apply_lora(model, rank=4, alpha=8, dropout=lora_dropout)
    with torch.no_grad():  # B starts at zero: randomise it so A gets a gradient too
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_()
    return model


def _step(model, batch=None, seed=0):
    ids, labels, seq = batch or _batch()
    torch.manual_seed(seed)  # same dropout masks in every mode
    loss = model.loss(ids, labels, seq)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_identical(a, b):
    assert torch.equal(a[0], b[0]), f"loss {a[0]} != {b[0]}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert a[1][name] is not None, name
        assert torch.equal(a[1][name], b[1][name]), f"gradient of {name} differs"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_full_finetune_bitwise_identical(request, family):
    path = request.getfixturevalue("checkpoint_dir" if family == "llama" else "qwen3_dir")
    reference = _step(_model(path))
    for name, kwargs in MODES.values():
        model = _model(path)
        apply_checkpointing(model, name, **kwargs)
        _assert_identical(_step(model), reference)


@pytest.mark.parametrize("aux_loss_coef", [0.0, 0.01])
def test_moe_bitwise_identical(moe_dir, aux_loss_coef):
    """Qwen3-MoE: routed experts offload like dense layers, with the auxiliary loss on too:
    the router stats are extra outputs of the offloaded layer's Function, so the aux
    gradient reaches the routers through the recompute."""
    from slipstream.models.moe_block import set_router_aux_loss_coef

    def run(mode, **kwargs):
        model = _model(moe_dir)
        set_router_aux_loss_coef(model, aux_loss_coef)
        pool = apply_checkpointing(model, mode, **kwargs)
        ids, labels, seq = _batch()
        loss, parts = model.loss(ids, labels, seq, return_parts=True)  # + coef * aux
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return (parts["lm_loss"], grads), parts.get("aux_loss"), pool

    reference, aux_reference, _ = run("none")
    assert all(g is not None for g in reference[1].values())
    assert (aux_reference is None) == (aux_loss_coef == 0)
    for name, kwargs in MODES.values():
        result, aux, pool = run(name, **kwargs)
        _assert_identical(result, reference)
        if aux_loss_coef:
            assert torch.equal(aux, aux_reference)
        if pool is not None:  # every layer but the last offloaded, aux loss or not
            assert pool.stats().bytes_offloaded == 2 * 23 * 32 * 4


@pytest.mark.parametrize("coef", [0.01, 0.3])
def test_moe_aux_loss_gradients_under_offload(moe_dir, coef):
    """The aux loss alone (the router stats the backbone returns, pooled as `model.loss`
    pools them), and loss + aux from two forwards before one backward: every gradient,
    routers included, as without checkpointing."""
    from slipstream.models.moe_block import set_router_aux_loss_coef
    from slipstream.ops.moe import load_balancing_loss

    def run(mode, **kwargs):
        model = _model(moe_dir)
        set_router_aux_loss_coef(model, coef)
        apply_checkpointing(model, mode, **kwargs)
        ids, _, seq = _batch()
        _, stats = model.model(ids, seq)
        load_balancing_loss(stats, len(ids)).backward()  # aux alone: layers' backward runs
        alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        objectives = []
        for seed in (1, 2):  # loss + coef * aux
            objectives.append(
                model.loss(*_batch(lengths=[9, 14] if seed == 2 else LENGTHS, seed=seed))
            )
        sum(objectives).backward()
        return alone, {n: p.grad for n, p in model.named_parameters()}

    ref_alone, ref_both = run("none")
    routers = [n for n in ref_alone if ".mlp.gate." in n]
    assert len(routers) == 3 and all(ref_alone[n].abs().sum() > 0 for n in routers)
    for name, kwargs in MODES.values():
        alone, both = run(name, **kwargs)
        for n in routers:
            assert torch.equal(alone[n], ref_alone[n]), f"aux-only gradient of {n}"
        for n, g in ref_both.items():
            assert torch.equal(both[n], g), f"gradient of {n} ({name})"


def test_moe_aux_loss_with_lora_leaving_routers_frozen(moe_dir):
    """LoRA on down_proj only: layer 0's router sees a frozen input and weight, so its
    recomputed probabilities need no grad though the offloaded layer's output was marked as
    needing it (autograd.grad raised "element 1 of tensors does not require grad")."""
    from slipstream.models.moe_block import set_router_aux_loss_coef
    from slipstream.peft.lora import apply_lora

    def run(mode, **kwargs):
        model = slipstream.load_model(moe_dir)
        torch.manual_seed(3)
        apply_lora(model, rank=4, alpha=8, targets=["down_proj"])
        set_router_aux_loss_coef(model, 0.01)
        apply_checkpointing(model, mode, **kwargs)
        ids, labels, seq = _batch()
        loss = model.loss(ids, labels, seq)  # + 0.01 * aux
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    reference = run("none")
    assert reference[1] and not any(".mlp.gate." in n for n in reference[1])
    for name, kwargs in MODES.values():
        _assert_identical(run(name, **kwargs), reference)


def test_moe_aux_loss_offload_step_has_no_host_syncs(moe_dir):
    from slipstream.models.moe_block import set_router_aux_loss_coef

    model = _model(moe_dir)
    set_router_aux_loss_coef(model, 0.01)
    pool = apply_checkpointing(model, "offload", **OFFLOAD)
    ids, labels, seq = _batch()
    for _ in range(2):  # the first step allocates the pool
        with count_syncs() as syncs:
            model.loss(ids, labels, seq).backward()  # + 0.01 * aux
    assert syncs.total == 0, str(syncs)
    assert pool.stats().bytes_offloaded == 2 * 2 * 23 * 32 * 4


def _lora_available() -> bool:
    try:
        import slipstream.peft.lora  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _lora_available(), reason="slipstream/peft/lora.py not built yet")
def test_lora_with_dropout_bitwise_identical(checkpoint_dir):
    reference = _step(_model(checkpoint_dir, lora_dropout=0.2))
    assert len(reference[1]) == 2 * 7 * LAYERS  # lora_A and lora_B of 7 projections a layer
    for name, kwargs in MODES.values():
        model = _model(checkpoint_dir, lora_dropout=0.2)
        apply_checkpointing(model, name, **kwargs)
        _assert_identical(_step(model), reference)


@pytest.mark.skipif(not _lora_available(), reason="slipstream/peft/lora.py not built yet")
def test_dropout_needs_preserved_rng(checkpoint_dir):
    """Shows the RNG restore matters: without it the recompute draws other dropout masks."""
    reference = _step(_model(checkpoint_dir, lora_dropout=0.2))
    model = _model(checkpoint_dir, lora_dropout=0.2)
    apply_checkpointing(model, "offload", preserve_rng_state=False, **OFFLOAD)
    loss, grads = _step(model)
    assert torch.equal(loss, reference[0])  # forward is untouched
    assert not all(torch.equal(grads[n], reference[1][n]) for n in grads)


@pytest.mark.parametrize("forwards", [2, 3])
def test_gradient_accumulation_forwards_then_one_backward(checkpoint_dir, forwards):
    """Several graphs alive at once: several offloaded inputs per layer, backward in engine
    order. Each graph's last-layer input must stay on the device until its backward: in a
    buffer while one is free, else in its own tensor (reloads then go to a tensor of their
    own too when no buffer is free), so the pool holds one layer input per live graph (the
    design before held those plus both buffers)."""

    def run(model):
        torch.manual_seed(0)
        losses = [model.loss(*_batch(seed=s)) for s in range(1, forwards + 1)]
        sum(losses).backward()
        return sum(loss.detach() for loss in losses), {
            n: p.grad for n, p in model.named_parameters()
        }

    reference = run(_model(checkpoint_dir))
    for double in (True, False):
        model = _model(checkpoint_dir)
        pool = apply_checkpointing(model, "offload", **{**OFFLOAD, "double_buffer": double})
        _assert_identical(run(model), reference)
        assert pool.stats().max_resident == forwards
        assert pool.live_device_inputs() == (2 if double else 1)  # the extra tensors are gone
        assert pool.stats().bytes_reloaded == pool.stats().bytes_offloaded


def test_compiled_layer_in_recompute_mode(checkpoint_dir):
    """torch.compile (dynamo) of a checkpointed layer: a context_fn that is a nested function
    made it raise "checkpoint not implemented for NestedUserFunctionVariable context_fn"."""
    reference = _step(_model(checkpoint_dir))
    model = _model(checkpoint_dir)
    apply_checkpointing(model, "recompute")
    model.model.layers[0].compile(backend="eager", dynamic=False)
    try:
        _assert_identical(_step(model), reference)
    finally:
        torch._dynamo.reset()


def _position(events, event):
    assert events.count(event) == 1, f"{event} occurs {events.count(event)} times"
    return events.index(event)


def _max_resident(events):
    """Replay the log: a kept or reloaded input occupies a buffer until its backward ends."""
    resident, most = set(), 0
    for what, layer in events:
        if what in ("prefetch", "keep"):
            resident.add(layer)
        elif what == "backward_end":
            resident.discard(layer)
        most = max(most, len(resident))
    return most


@pytest.mark.parametrize("double", [True, False])
def test_schedule(checkpoint_dir, double):
    model = _model(checkpoint_dir)
    pool = apply_checkpointing(model, "offload", **{**OFFLOAD, "double_buffer": double})
    _step(model)
    ev = pool.events
    offloaded = [layer for what, layer in ev if what == "offload"]
    assert offloaded == list(range(LAYERS - 1))  # the last layer's input stays on the device,
    assert _position(ev, ("keep", LAYERS - 1)) < _position(ev, ("backward_start", LAYERS - 1))
    for j in offloaded:  # ... in a reload buffer, which it holds during its backward
        prefetch = _position(ev, ("prefetch", j))
        # Issued before the backward that needs it starts ...
        assert prefetch < _position(ev, ("backward_start", j))
        if double:  # ... as soon as the layer after it starts, ahead of that one's recompute
            assert _position(ev, ("backward_start", j + 1)) < prefetch
            assert prefetch < _position(ev, ("recompute", j + 1))
        else:  # ... once layer j+1 (the last one too: it holds the buffer) frees the buffer
            assert _position(ev, ("backward_end", j + 1)) < prefetch
    want = 2 if double else 1
    assert _max_resident(ev) == want
    stats = pool.stats()
    assert (stats.num_buffers, stats.max_resident, stats.steps) == (want, want, 1)
    assert stats.bytes_offloaded == stats.bytes_reloaded == (LAYERS - 1) * 23 * 48 * 4


def test_pool_out_of_order_backward_takes_a_prefetch_back():
    """Backward in an order the prefetch did not guess: the input still comes back intact."""
    pool = OffloadPool(pin=False, min_offload_bytes=0, double_buffer=False, record_events=True)
    xs = [torch.randn(5, 3) + i for i in range(3)]
    saved = [pool.save(i, x) for i, x in enumerate(xs)]
    pool.backward_start(3, None)  # layer 3 kept its input: prefetches layer 2 into the buffer
    for i in (0, 2, 1):  # layer 0 first takes the buffer from layer 2's prefetch
        pool.backward_start(i, saved[i])
        assert torch.equal(pool.input_for(saved[i]), xs[i])
        pool.backward_end(i, saved[i])
    assert pool.events.count(("prefetch", 2)) == 2
    assert pool.stats().max_resident == 1
    with pytest.raises(RuntimeError, match="retain_graph"):
        pool.backward_start(0, saved[0])


class _FakeEvent:
    """Stands for a compute-stream event: the device tensors the pool held when recorded."""

    def __init__(self, alive: list[torch.Tensor]) -> None:
        self.alive = alive


class _RecordingCopies(pool_impl._SyncCopies):
    """The CPU twin with fake events, logging each copy-stream write into device memory as
    (destination tensor, tracked for the copy stream?, event it waited on)."""

    def __init__(self, pool: OffloadPool) -> None:
        self.pool, self.tracked, self.writes = pool, [], []

    def record_compute(self) -> _FakeEvent:
        own = [s.own for s in self.pool.own_inputs if s.own is not None]
        return _FakeEvent([*self.pool.buffers, *own])

    def track(self, device_tensor: torch.Tensor) -> None:
        self.tracked.append(device_tensor)

    def copy(self, kind, dst, src, after) -> None:
        super().copy(kind, dst, src, after)
        if kind == "h2d":
            base = dst if dst._base is None else dst._base
            self.writes.append((base, any(t is base for t in self.tracked), after))


def _copy_stream_writes(path, double):
    """Writes into fresh buffers (first step), tensors of their own (three graphs alive for
    two buffers) and grown buffers (a longer batch), per phase."""
    model = _model(path)
    pool = apply_checkpointing(model, "offload", **{**OFFLOAD, "double_buffer": double})
    pool.copies, pool.device = _RecordingCopies(pool), torch.device("cpu")
    phases = {}
    _step(model)
    phases["fresh"], buffers = list(pool.copies.writes), list(pool.buffers)
    sum(model.loss(*_batch(seed=s)) for s in (1, 2, 3)).backward()
    phases["own"] = pool.copies.writes[len(phases["fresh"]) :]
    assert any(all(base is not b for b in buffers) for base, *_ in phases["own"])
    done = len(pool.copies.writes)
    _step(model, _batch([30, 10]))
    phases["grown"] = pool.copies.writes[done:]
    assert all(a is not b for a in pool.buffers for b in buffers)  # each buffer was replaced
    assert any(base is pool.buffers[-1] for base, *_ in phases["grown"])
    return phases


@pytest.mark.parametrize("double", [True, False])
def test_reloads_into_new_device_memory_wait_for_its_allocation(checkpoint_dir, double):
    """The allocator hands out blocks that queued compute kernels may still use: every copy
    into a new buffer (fresh or grown) or own tensor waits on a compute-stream event recorded
    after that memory was allocated (they waited on nothing, or a grown buffer on the event
    of the buffer it replaced)."""
    for phase, writes in _copy_stream_writes(checkpoint_dir, double).items():
        for base, _, after in writes:
            assert after is not None, f"{phase}: a reload waited on no event"
            assert any(t is base for t in after.alive), f"{phase}: waited on an older event"


@pytest.mark.parametrize("double", [True, False])
def test_device_memory_the_copy_stream_writes_is_tracked(checkpoint_dir, double):
    """Every device tensor the copy stream writes is `record_stream`ed for it (`track`), so a
    pool, graph or grown buffer dropped while a prefetch is queued keeps its block until the
    copy lands (only a grown buffer was, on its way out)."""
    for phase, writes in _copy_stream_writes(checkpoint_dir, double).items():
        assert writes and all(tracked for _, tracked, _ in writes), phase


def test_pool_drops_host_slots_too_small_for_a_longer_batch():
    """Each longer batch left the previous, too small slot in the free list for good."""
    pool = OffloadPool(pin=False, min_offload_bytes=0, double_buffer=False)
    for tokens in (5, 9, 7, 12, 4):
        x = torch.randn(tokens, 3)
        saved = pool.save(0, x)
        pool.backward_start(0, saved)
        assert torch.equal(pool.input_for(saved), x)
        pool.backward_end(0, saved)
    assert [slot.numel() for slot in pool.free_slots[0]] == [12 * 3 * 4]
    assert (pool.stats().host_bytes, pool.stats().host_allocations) == (12 * 3 * 4, 3)


def test_pinned_host_slots_are_whole_powers_of_two():
    """The pinned CachingHostAllocator rounds each block up to a power of two: the pool asks
    for that size, so host_bytes is what is pinned (and a slightly longer batch fits)."""
    sizes = [1, 1000, 1024, 1025, 3 << 20]
    assert [OffloadPool(pin=True)._slot_bytes(n) for n in sizes] == [1, 1024, 1024, 2048, 4 << 20]
    assert [OffloadPool(pin=False)._slot_bytes(n) for n in sizes] == sizes


def test_second_buffer_counts_memory_the_allocator_holds_free(monkeypatch, caplog):
    """`mem_get_info` counts blocks torch's caching allocator reserved but has not handed
    out as used: they are free to the buffers too."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    monkeypatch.setattr(pool_impl, "_LOGGED", set())
    pool = OffloadPool(pin=False)
    pool.device = torch.device("cuda", 0)
    # Two 1 GiB buffers need 18 GiB: 1 GiB free on the device + 20 GiB cached by torch.
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    assert pool._buffer_count(gib) == 2
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * gib)
    with caplog.at_level(logging.WARNING, logger="slipstream.memory.offload"):
        assert pool._buffer_count(gib) == 1
    assert "3.0 GiB free on cuda:0" in caplog.text


@pytest.mark.parametrize("double", [True, False])
def test_backward_holds_at_most_two_layer_inputs(checkpoint_dir, double):
    """Every layer-input-sized device tensor alive during backward is one the pool holds (no
    layer input survives forward elsewhere), and the pool holds at most two at every event,
    the last layer's backward included (one with a single buffer)."""
    model = _model(checkpoint_dir)
    pool = apply_checkpointing(model, "offload", **{**OFFLOAD, "double_buffer": double})
    _step(model)  # first step allocates the buffers
    inputs, counts = [], []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    note = pool._note

    def counting_note(what, index):
        note(what, index)
        if what in ("backward_start", "prefetch", "recompute", "backward_end"):
            assert all(r() is None for r in inputs), f"a layer input outlived forward ({what})"
            counts.append((what, index, pool.live_device_inputs()))

    pool._note = counting_note
    pool.reset_stats()
    loss = model.loss(*_batch())
    assert len(inputs) == LAYERS
    loss.backward()
    want = 2 if double else 1
    assert max(n for *_, n in counts) == want
    last = [n for what, index, n in counts if index == LAYERS - 1]
    assert last == [want] * 3  # backward_start, recompute, backward_end of the last layer
    if double:  # the prefetch of the layer below went into the other buffer meanwhile
        assert ("prefetch", LAYERS - 2, 2) in counts[: counts.index(("recompute", LAYERS - 1, 2))]
    assert pool.stats().max_resident == want
    assert pool.stats().num_buffers == want


def test_forward_without_backward_frees_its_buffer(checkpoint_dir):
    """A graph dropped before backward (a loss only looked at) gives its buffer back."""
    reference = _step(_model(checkpoint_dir))
    model = _model(checkpoint_dir)
    pool = apply_checkpointing(model, "offload", **OFFLOAD)
    _step(model)
    buffers = [b.data_ptr() for b in pool.buffers]
    for _ in range(3):
        model.loss(*_batch())  # dropped at once
    pool.reset_stats()
    model.zero_grad(set_to_none=True)
    _assert_identical(_step(model), reference)
    assert [b.data_ptr() for b in pool.buffers] == buffers
    assert pool.stats().max_resident == 2 and pool.live_device_inputs() == 2


def test_offloaded_inputs_leave_the_device_after_forward(checkpoint_dir):
    """Offload holds no reference to the layer inputs it copied out; recompute keeps them."""

    def alive_after_forward(mode, **kwargs):
        model = _model(checkpoint_dir)
        apply_checkpointing(model, mode, **kwargs)
        refs = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
        loss = model.loss(*_batch())
        alive = [r() is not None for r in refs]
        loss.backward()
        return alive

    # The last layer's input was copied into a reload buffer: the original is freed too.
    assert alive_after_forward("offload", **OFFLOAD) == [False] * LAYERS
    assert alive_after_forward("recompute") == [True] * LAYERS


def test_small_inputs_stay_on_device(checkpoint_dir):
    reference = _step(_model(checkpoint_dir))
    model = _model(checkpoint_dir)
    pool = apply_checkpointing(model, "offload", force=True, min_offload_bytes=23 * 48 * 4 + 1)
    _assert_identical(_step(model), reference)
    assert pool.stats().bytes_offloaded == 0 and pool.stats().num_buffers == 0


def test_pool_allocated_once_and_reused(checkpoint_dir):
    model = _model(checkpoint_dir)
    pool = apply_checkpointing(model, "offload", **OFFLOAD)
    _step(model)
    slots = {i: [s.data_ptr() for s in pool.free_slots[i]] for i in pool.free_slots}
    buffers = [b.data_ptr() for b in pool.buffers]
    assert pool.stats().host_allocations == LAYERS - 1
    for _ in range(2):  # same or fewer tokens: no new host slot, no new buffer
        _step(model, _batch([5, 9, 2]))
    assert pool.stats().host_allocations == LAYERS - 1
    assert {i: [s.data_ptr() for s in pool.free_slots[i]] for i in pool.free_slots} == slots
    assert [b.data_ptr() for b in pool.buffers] == buffers
    _step(model, _batch([30, 10]))  # a longer batch grows each slot once
    assert pool.stats().host_allocations == 2 * (LAYERS - 1)
    assert pool.stats().steps == 4
    # ... and the slots it outgrew are gone: one slot a layer, as many bytes as reported
    assert all(len(pool.free_slots[i]) == 1 for i in range(LAYERS - 1))
    slots = [s.numel() for i in range(LAYERS - 1) for s in pool.free_slots[i]]
    assert slots == [40 * 48 * 4] * (LAYERS - 1) and pool.stats().host_bytes == sum(slots)


def test_offload_step_has_no_host_syncs(checkpoint_dir):
    model = _model(checkpoint_dir)
    apply_checkpointing(model, "offload", **OFFLOAD)
    ids, labels, seq = _batch()
    _step(model)  # first step allocates the pool
    with count_syncs() as syncs:
        model.loss(ids, labels, seq).backward()
    assert syncs.total == 0, str(syncs)


def test_eval_forward_offloads_nothing(checkpoint_dir):
    model = _model(checkpoint_dir)
    ids, _, seq = _batch()
    with torch.no_grad():
        reference = model(ids, seq)
        pool = apply_checkpointing(model, "offload", **OFFLOAD)
        assert torch.equal(model(ids, seq), reference)
    assert pool.events == []


def test_state_dict_names_unchanged_and_none_undoes(checkpoint_dir):
    model = _model(checkpoint_dir)
    keys = list(model.state_dict().keys())
    classes = [type(layer) for layer in model.model.layers]
    for mode, kwargs in MODES.values():
        apply_checkpointing(model, mode, **kwargs)
        assert list(model.state_dict().keys()) == keys
        assert all(type(a) is not b for a, b in zip(model.model.layers, classes))
    apply_checkpointing(model, "none")
    assert [type(layer) for layer in model.model.layers] == classes
    assert not any("_slipstream_plan" in vars(layer) for layer in model.model.layers)
    assert get_offload_pool(model) is None


def test_none_leaves_model_untouched(checkpoint_dir):
    model = _model(checkpoint_dir)
    before = [(type(layer), dict(vars(layer))) for layer in model.model.layers]
    assert apply_checkpointing(model, "none") is None
    assert [(type(layer), dict(vars(layer))) for layer in model.model.layers] == before


def test_offload_on_cpu_without_force_recomputes(checkpoint_dir, caplog, monkeypatch):
    reference = _step(_model(checkpoint_dir))
    model = _model(checkpoint_dir)
    monkeypatch.setattr(pool_impl, "_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger="slipstream.memory.offload"):
        assert apply_checkpointing(model, "offload") is None
        apply_checkpointing(model, "offload")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("needs a CUDA device" in m for m in messages) == 1  # said once, not per call
    assert all(layer._slipstream_plan.mode == "recompute" for layer in model.model.layers)
    _assert_identical(_step(model), reference)


def test_bad_arguments_are_one_line_value_errors(checkpoint_dir):
    model = _model(checkpoint_dir)
    with pytest.raises(ValueError, match="'swap'.*offload, recompute, none") as e:
        apply_checkpointing(model, "swap")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="double_buffer='yes'"):
        apply_checkpointing(model, "offload", double_buffer="yes")
    with pytest.raises(ValueError, match="decoder_layers"):
        apply_checkpointing(torch.nn.Linear(2, 2), "recompute")


# --- CUDA -----------------------------------------------------------------------------------


def _cuda_model(path, mode, **kwargs):
    model = slipstream.load_model(path, dtype=torch.float32, device="cuda")
    model.requires_grad_(True)
    pool = apply_checkpointing(model, mode, **kwargs)
    return model, pool


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("double", [True, False])
def test_cuda_offload_matches_recompute(cuda_dir, double):
    ids, labels, _ = _batch()
    batch = (ids.cuda(), labels.cuda(), SeqInfo.from_lengths(LENGTHS, device="cuda"))
    reference = _step(_cuda_model(cuda_dir, "recompute")[0], batch)
    model, pool = _cuda_model(
        cuda_dir, "offload", min_offload_bytes=0, double_buffer=double, timing=True
    )
    _assert_identical(_step(model, batch), reference)
    stats = pool.stats()
    assert stats.num_buffers == (2 if double else 1)
    assert stats.h2d_ms is not None and stats.exposed_ms is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_pool_reused_and_sync_free(cuda_dir):
    ids, labels, _ = _batch()
    batch = (ids.cuda(), labels.cuda(), SeqInfo.from_lengths(LENGTHS, device="cuda"))
    model, pool = _cuda_model(cuda_dir, "offload", min_offload_bytes=0)
    _step(model, batch)
    assert all(s.is_pinned() for slots in pool.free_slots.values() for s in slots)
    ptrs = sorted(s.data_ptr() for slots in pool.free_slots.values() for s in slots)
    with count_syncs() as syncs:
        model.loss(*batch).backward()
    assert syncs.total == 0, str(syncs)
    torch.cuda.synchronize()
    assert sorted(s.data_ptr() for slots in pool.free_slots.values() for s in slots) == ptrs
    assert pool.stats().host_allocations == LAYERS - 1
    sizes = [s.numel() for slots in pool.free_slots.values() for s in slots]
    assert all(n & (n - 1) == 0 for n in sizes) and pool.stats().host_bytes == sum(sizes)


def _cuda_pool_with_two_offloaded(nbytes):
    """A single-buffer pool holding two offloaded inputs (values 1 and 2) on the host."""
    pool = OffloadPool(min_offload_bytes=0, double_buffer=False)
    xs = [torch.full((nbytes // 4,), float(i + 1), device="cuda") for i in range(2)]
    saved = [pool.save(i, x) for i, x in enumerate(xs)]
    torch.cuda.synchronize()  # both copies to the host have landed
    return pool, xs, saved


# 16 MiB: over the allocator's 10 MiB "large" limit, so a block of its own that the next
# request of that size gets back exactly; _sleep(10**8) spins 1e8 GPU cycles, ~50 ms at an
# H200's ~2 GHz clock.
_BLOCK, _SLEEP = 16 << 20, 10**8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_first_reload_waits_for_kernels_on_its_block():
    """A block freed on the compute stream is handed out again at once: the first reload
    into a new buffer must wait for the kernels queued before its allocation."""
    pool, xs, saved = _cuda_pool_with_two_offloaded(_BLOCK)
    block = torch.ones(_BLOCK // 4, device="cuda")
    torch.cuda._sleep(_SLEEP)  # the compute stream reads `block` ~50 ms from now
    doubled = block * 2
    del block  # back to the compute stream's free blocks: the buffer below gets it
    pool.backward_start(2, None)  # allocates the buffer, prefetches layer 1's input (2.0)
    torch.cuda.synchronize()
    assert torch.equal(doubled, torch.full_like(doubled, 2.0)), "the reload overwrote it"
    pool.backward_start(1, saved[1])
    assert torch.equal(pool.input_for(saved[1]), xs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_dropped_mid_prefetch_keeps_its_buffer():
    """A pool (or graph) dropped while a reload into its buffer is queued: the buffer's block
    must not be handed out before the copy stream has written it."""
    pool, xs, saved = _cuda_pool_with_two_offloaded(_BLOCK)
    with torch.cuda.stream(pool.copies.stream):
        torch.cuda._sleep(_SLEEP)  # the prefetch below lands ~50 ms from now
    pool.backward_start(2, None)  # prefetches layer 1's input into the only buffer
    del pool, saved
    gc.collect()
    fresh = torch.zeros(_BLOCK // 4, device="cuda")  # same size: would get the buffer's block
    torch.cuda.synchronize()
    assert torch.equal(fresh, torch.zeros_like(fresh)), "the prefetch landed in a new tensor"
