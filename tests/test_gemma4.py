"""Gemma 4 text (gemma4_text) against transformers through load_model: logits, loss and every
gradient, packing, syncs, greedy generation, LoRA adapters in peft, merged export.

The tiny configs (tests/helpers/tiny_hf.py `gemma4_text`) make each Gemma 4 detail matter:
4 layers alternating sliding (window 4, shorter than the 11-token sequence) and full, full
layers with their own head dim (16 vs 8) and KV heads (1 vs 2) and k = v, per-layer inputs,
layers 2-3 reusing layers 0-1's K/V with double-wide MLPs, final softcapping; the MoE variant
adds the routed block beside the dense MLP (here with per-layer inputs and K/V sharing too,
and tied embeddings). Norm weights, layer scalars and the router's scales are randomised
(ones by default, so a dropped one would not show).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.models import per_sequence_logits, randomise_lora_b, shifted_labels
from helpers.tiny_hf import tiny_config

import slipstream
from slipstream.debug import count_syncs
from slipstream.memory.offload import apply_checkpointing
from slipstream.ops.packing import SeqInfo

VOCAB = 96
LENGTHS = [7, 11, 3]
VARIANTS = {
    "dense": ("gemma4_text", {}),
    "moe": ("gemma4_text_moe", {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2,
                                "use_double_wide_mlp": True, "tie_word_embeddings": True}),
}  # fmt: skip


def make_hf(variant: str = "dense", layers: int = 4, seed: int = 0):
    from transformers import AutoModelForCausalLM

    model_type, extra = VARIANTS[variant]
    extra = {**extra, "num_kv_shared_layers": layers // 2 if layers > 2 else 0}
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, layers, **extra)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_(1 + 0.2 * torch.randn_like(t))
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_dir(request, tmp_path_factory):
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hf = make_hf(request.param)
    path = tmp_path_factory.mktemp(f"gemma4_{request.param}")
    hf.save_pretrained(path)
    return hf, path


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_logits_loss_and_every_gradient_equal_transformers(hf_dir):
    """Packed logits equal transformers run per sequence; the summed loss and the gradient
    of every parameter (same names) equal transformers' loss over the same sequences."""
    hf, path = hf_dir
    hf = copy.deepcopy(hf)
    ours = slipstream.load_model(path)
    cfg = ours.config
    assert cfg.kv_source == (0, 1, 0, 1) and cfg.head_dims == (8, 16, 8, 16)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, None, 4, None]
    ids = _ids(sum(LENGTHS), seed=1)
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    logits = per_sequence_logits(hf, ids, LENGTHS)
    keep = labels != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    ref.backward()
    with torch.no_grad():
        assert _rel(ours(ids, seq), logits) < 1e-4
    loss = ours.loss(ids, labels, seq, reduction="sum", label_positions=keep.nonzero()[:, 0])
    loss.backward()
    assert abs(loss.item() - ref.item()) < 1e-4 * abs(ref.item())
    theirs = dict(hf.named_parameters())
    names = [n for n, _ in ours.named_parameters()]
    assert set(names) == set(theirs)
    for name, p in ours.named_parameters():
        assert _rel(p.grad, theirs[name].grad) < 1e-4, name


def test_packed_equals_each_sequence_alone(hf_dir):
    _, path = hf_dir
    ours = slipstream.load_model(path)
    ids = _ids(sum(LENGTHS), seed=2)
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(LENGTHS))
        alone = torch.cat([ours(s, SeqInfo.from_lengths([len(s)])) for s in ids.split(LENGTHS)])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layers", [2, 8])
def test_a_training_step_has_no_host_sync(tmp_path, layers, variant):
    """LoRA step under offload (forced on CPU: the real schedule), 2 and 8 layers (8: 4 of
    them reuse K/V and take the recompute path, their K/V arriving with grad)."""
    hf = make_hf(variant, layers)
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    apply_checkpointing(ours, "offload", force=True, min_offload_bytes=0)
    ids = _ids(sum(LENGTHS), seed=3)
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    positions = (labels != -100).nonzero()[:, 0]
    ours.loss(ids, labels, seq, label_positions=positions).backward()  # allocates the pool
    with count_syncs() as syncs:
        ours.loss(ids, labels, seq, label_positions=positions).backward()
    assert syncs.total == 0, str(syncs)


def test_offload_and_recompute_give_the_gradients_of_none(hf_dir):
    _, path = hf_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    ids = _ids(sum(LENGTHS), seed=4)
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)

    def grads(mode):
        apply_checkpointing(ours, mode, force=True, min_offload_bytes=0)
        ours.zero_grad()
        ours.loss(ids, labels, seq).backward()
        return {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}

    plain = grads("none")
    assert any("layers.0.self_attn.k_proj" in n for n in plain)  # reached through layer 2
    for mode in ("offload", "recompute"):
        got = grads(mode)
        assert set(got) == set(plain)
        for name in plain:
            torch.testing.assert_close(got[name], plain[name], rtol=1e-5, atol=1e-6)


def test_greedy_generation_equals_transformers_generate(hf_dir):
    """Mixed-length prompts (9 + 10 tokens > the window of 4), 2 samples each (the prefilled
    cache rows repeated), one prompt stopping early: with a stop check every 2 tokens its rows
    leave the cache after 4 while the others decode on 6 more, the sharing layers reading
    their compacted source layers' K/V."""
    from slipstream.generation import engine

    hf, path = hf_dir
    ours = slipstream.load_model(path)
    prompts = [[5, 9, 11, 4], [7, 3, 8, 20, 21, 22, 40, 41, 42], [17]]
    new = 10

    def reference(p, stop=None):
        out = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                          eos_token_id=stop, pad_token_id=0)  # fmt: skip
        return out[0, len(p) :].tolist()

    stop = reference(prompts[0])[2]  # prompt 0 stops at its third token
    greedy = engine.Sampling(0.0, 1.0, 0)
    rows = engine.run(ours, prompts, samples_per_prompt=2, max_new_tokens=new,
                      sampling=greedy, stop_ids=[stop], check_every=2)  # fmt: skip
    assert [r.prompt_index for r in rows] == [0, 0, 1, 1, 2, 2]
    for r in rows[:2]:
        assert r.finish_reason == "stop" and len(r.token_ids) <= 3
    assert any(len(r.token_ids) == new for r in rows[2:])  # the others ran past its drop
    for row in rows:
        assert list(row.token_ids) == reference(prompts[row.prompt_index], stop)


def test_native_equals_generic_on_the_same_checkpoint(hf_dir):
    _, path = hf_dir
    native = slipstream.load_model(path)
    generic = slipstream.load_model(path, implementation="transformers")
    assert type(generic).__name__ == "GenericCausalLM"
    ids = _ids(sum(LENGTHS), seed=5)
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    with torch.no_grad():
        assert _rel(native(ids, seq), generic(ids, seq)) < 1e-4
        a, b = native.loss(ids, labels, seq), generic.loss(ids, labels, seq)
    assert abs(a.item() - b.item()) < 1e-4 * abs(b.item())
    assert native.kv_layout() == [(2, 8, 0), (1, 16, 1), (2, 8, 0), (1, 16, 1)]
    assert [(G, Dh) for G, Dh, _ in generic.kv_layout()] == [(2, 8), (1, 16)] * 2


def test_lora_adapter_loads_in_peft_with_same_logits_and_grads(hf_dir, tmp_path):
    """All-linear LoRA (per-layer input gates, and expert LoRA on the MoE's stacked experts,
    saved as peft's target_parameters) loads in peft: the same logits and every factor's
    gradient (the experts' in peft's layout); loaded back into ours, the same logits."""
    from peft import PeftModel

    from slipstream.peft.lora_experts import expert_lora_modules, expert_lora_tensors

    hf, path = hf_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {"per_layer_input_gate", "q_proj", "down_proj"} <= set(cfg["target_modules"])
    moe = ours.config.num_experts > 0
    assert cfg.get("target_parameters") == (
        ["experts.gate_up_proj", "experts.down_proj"] if moe else None
    )
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path, is_trainable=True)
    ids = _ids(sum(LENGTHS), seed=6)
    labels = shifted_labels(ids, LENGTHS)
    keep = labels != -100
    expected = per_sequence_logits(peft_model.eval(), ids, LENGTHS)
    ref = torch.nn.functional.cross_entropy(expected[keep], labels[keep], reduction="sum")
    ref.backward()
    ours.loss(ids, labels, SeqInfo.from_lengths(LENGTHS), reduction="sum").backward()
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
        base = per_sequence_logits(hf, ids, LENGTHS)
    assert _rel(got, expected) < 1e-4
    assert _rel(base, expected) > 1e-3  # the adapter changed the output
    back = slipstream.load_adapter(slipstream.load_model(path), tmp_path)  # and back into ours
    with torch.no_grad():
        torch.testing.assert_close(back(ids, SeqInfo.from_lengths(LENGTHS)), got)
    theirs = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters()}
    grads = {f"base_model.model.{n}": p.grad for n, p in ours.named_parameters()
             if "lora_" in n and ".experts." not in n}  # fmt: skip
    with torch.no_grad():  # the expert factors' gradients, written out in peft's layout
        for m in expert_lora_modules(ours).values():
            for p in [*m.lora_A.values(), *m.lora_B.values()]:
                p.copy_(p.grad)
    grads.update(expert_lora_tensors(ours))
    assert any(".experts." in k for k in grads) == moe
    assert set(grads) == {n for n in theirs if "lora_" in n}
    for name, grad in grads.items():
        assert _rel(grad, theirs[name]) < 1e-4, name


def test_export_merged_loads_in_transformers(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    _, path = hf_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    ids = _ids(11, seed=7)
    with torch.no_grad():
        expected = ours(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(ours, tmp_path / "merged")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(back).__name__ == "Gemma4ForCausalLM"
    with torch.no_grad():
        assert _rel(back(ids[None]).logits[0], expected) < 1e-4


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
        ("hidden_activation", "relu", "hidden_activation 'relu'"),
        ("num_kv_shared_layers", 3, "layer 1 .full_attention. shares K/V"),
    ],
)
def test_unsupported_configs_are_one_line_errors(key, value, match):
    from slipstream.models import gemma4

    hf = {**make_hf("dense").config.to_dict(), key: value}
    with pytest.raises(ValueError, match=match) as e:
        gemma4.config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_image_text_checkpoint_trains_its_language_model(tmp_path):
    """`gemma4` (Gemma4ForConditionalGeneration): the language model loads from
    model.language_model.*, the vision tower stays on disk and comes back in the merged
    export, which transformers loads with our logits."""
    from transformers import AutoConfig, Gemma4Config, Gemma4ForConditionalGeneration

    vision = AutoConfig.for_model("gemma4_vision", hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=8)  # fmt: skip
    text = make_hf("dense").config.to_dict()
    cfg = Gemma4Config(text_config=text, vision_config=vision.to_dict())
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(cfg).float().eval()
    hf.save_pretrained(tmp_path / "mm")
    ours = slipstream.load_model(tmp_path / "mm")
    assert ours.config.model_type == "gemma4" and ours.config.kv_source == (0, 1, 0, 1)
    ids = _ids(11, seed=8)
    with torch.no_grad():
        assert _rel(ours(ids, SeqInfo.from_lengths([11])), hf(input_ids=ids[None]).logits[0]) < 1e-4
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    with torch.no_grad():
        expected = ours(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(ours, tmp_path / "merged")
    back = Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "merged").float().eval()
    with torch.no_grad():
        assert _rel(back(input_ids=ids[None]).logits[0], expected) < 1e-4
    for name, t in hf.model.vision_tower.state_dict().items():
        assert torch.equal(back.model.vision_tower.state_dict()[name], t), name


def test_generation_logprobs_are_of_the_softcapped_logits(hf_dir):
    """The engine's log-probs (GRPO's rollout log-probs) are of transformers' logits, final
    softcap included (tanh(z / 30) * 30 moves these by a few percent)."""
    from slipstream.generation import engine

    hf, path = hf_dir
    ours = slipstream.load_model(path)
    prompt = [5, 9, 11, 4, 30, 31]
    greedy = engine.Sampling(0.0, 1.0, 0)
    (row,) = engine.run(ours, [prompt], max_new_tokens=4, sampling=greedy, logprobs=True)
    full = torch.tensor([prompt + list(row.token_ids)])
    with torch.no_grad():
        logp = hf(full).logits[0].log_softmax(-1)
    n = len(prompt)
    want = [logp[n - 1 + i, t].item() for i, t in enumerate(row.token_ids)]
    assert row.logprobs == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_eval_scores_are_of_the_softcapped_logits(hf_dir):
    from slipstream.evaluation.scoring import score

    hf, path = hf_dir
    context, continuation = [5, 9, 11, 4], [30, 31, 32]
    ((logprob, _),) = score(slipstream.load_model(path), [(context, continuation)], max_length=64)
    with torch.no_grad():
        logp = hf(torch.tensor([context + continuation])).logits[0].log_softmax(-1)
    want = sum(logp[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))
    assert logprob == pytest.approx(want, rel=1e-4)
