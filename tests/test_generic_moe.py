"""The router load-balancing loss on generic MoE models: transformers' own (its class's
`load_balancing_loss_func` over the router logits it records), added by `model.loss` as the
native families add theirs; compared with transformers' `loss` on a padded batch."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_hf import tiny_config
from test_generic import LENGTHS, _batch, _rel, quiet  # noqa: F401 (quiet: a fixture)

from slipstream.checkpoint.hf import load_model
from slipstream.debug import count_syncs
from slipstream.models.moe_block import has_router_loss, set_router_aux_loss_coef

pytestmark = pytest.mark.usefixtures("quiet")
COEF = 0.5  # big enough that a wrong aux term moves the loss past the tolerance
ROUTED = ["mixtral"] + [
    pytest.param(t, marks=pytest.mark.slow)
    for t in ("qwen2_moe", "granitemoe", "ernie4_5_moe", "minimax_m2", "qwen3_next", "gpt_oss")
]


def _checkpoint(tmp_path, model_type, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(model_type, **overrides)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    ref.save_pretrained(tmp_path / "ckpt")
    return ref


def _padded(ids, labels_shifted):
    """transformers' batch of the packed sequences: right-padded ids, mask and its labels
    (unshifted: transformers shifts), -100 on padding."""
    B, S = len(LENGTHS), max(LENGTHS)
    input_ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), -100)
    for i, (seq_ids, seq_labels) in enumerate(
        zip(ids.split(LENGTHS), labels_shifted.split(LENGTHS), strict=True)
    ):
        n = len(seq_ids)
        input_ids[i, :n], mask[i, :n] = seq_ids, 1
        labels[i, 1:n] = seq_labels[: n - 1]
    return input_ids, mask, labels


@pytest.mark.parametrize("model_type", ROUTED)
def test_router_loss_equals_transformers(tmp_path, model_type):
    """`output_router_logits: true` in config.json turns it on (transformers' rule): loss,
    aux part and every gradient equal transformers' on the padded batch; no host sync."""
    ref = _checkpoint(tmp_path, model_type, output_router_logits=True, router_aux_loss_coef=COEF)
    ours = load_model(tmp_path / "ckpt", implementation="transformers")
    assert ours.router_aux_loss_coef == COEF
    ids, labels, seq = _batch()
    input_ids, mask, padded_labels = _padded(ids, labels)
    want = ref(input_ids=input_ids, attention_mask=mask, labels=padded_labels)
    want.loss.backward()
    with count_syncs() as syncs:
        loss, parts = ours.loss(ids, labels, seq, return_parts=True)
        loss.backward()
    assert syncs.total == 0, syncs
    assert want.aux_loss.item() > 0.1
    assert parts["aux_loss"].item() == pytest.approx(want.aux_loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    theirs = dict(ref.named_parameters())
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert grads.keys() == {n for n, p in theirs.items() if p.grad is not None}
    for name, grad in grads.items():
        assert _rel(grad, theirs[name].grad) < 1e-4, name
    # reduction "sum": coef * aux * N, so the trainer's one division gives loss + coef * aux
    n = (labels != -100).sum()
    total, parts = ours.loss(ids, labels, seq, reduction="sum", return_parts=True)
    assert (total / n).item() == pytest.approx(want.loss.item(), rel=1e-5)
    assert (parts["aux_loss"] / n).item() == pytest.approx(want.aux_loss.item(), rel=1e-5)


def test_off_by_default_and_refused_where_transformers_has_none(tmp_path):
    """Hub checkpoints say output_router_logits: false: no aux term, as in transformers;
    train.router_aux_loss_coef turns it on. glm4_moe's routers (bias balancing) have none."""
    _checkpoint(tmp_path, "mixtral")
    ours = load_model(tmp_path / "ckpt", implementation="transformers")
    ids, labels, seq = _batch()
    assert ours.router_aux_loss_coef == 0.0 and has_router_loss(ours)
    _, parts = ours.loss(ids, labels, seq, return_parts=True)
    assert set(parts) == {"lm_loss"}
    set_router_aux_loss_coef(ours, 0.1)
    _, parts = ours.loss(ids, labels, seq, return_parts=True)
    assert parts["aux_loss"].item() > 0
    _checkpoint(tmp_path / "glm", "glm4_moe")
    glm = load_model(tmp_path / "glm" / "ckpt")
    assert not has_router_loss(glm) and glm.router_aux_loss_coef == 0.0
