"""Qwen2, windowed Mistral and Phi-3 against transformers, through `slipstream.load_model`.

Windows are 4 on sequences of up to 12 tokens, so they bite; a window off by one in either
direction is shown to fail the same comparison. The Phi-3 longrope case has
original_max_position_embeddings 8: the packed batch mixes sequences on both sides of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import LLAMA_BASE, assert_loss_and_grads_match, make_hf_model, shifted_labels

import slipstream
from slipstream.ops.packing import SeqInfo

WINDOW = 4
LENGTHS = [12, 3, 9, 1]
LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3], long_factor=[2.0, 5.0]
)

CASES = {
    "qwen2-window-layer1": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_theta=1e6),
    ),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=3)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "phi3-window": ("phi3", dict(sliding_window=WINDOW)),
    "phi3-partial-longrope": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            rope_parameters=LONGROPE,
            original_max_position_embeddings=8,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
    ),
}


def _hf_model(model_type: str, **overrides):
    hf = make_hf_model(model_type, **overrides)
    with torch.no_grad():  # zeros by default: randomise so a dropped bias shows up
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    hf = _hf_model(model_type, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, slipstream.load_model(path)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, LLAMA_BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    )


def _max_diff_per_sequence(hf, ours, lengths) -> float:
    """Largest |our packed logits - transformers' logits of each sequence alone|."""
    ids = _ids(sum(lengths))
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(lengths))
        diffs, start = [], 0
        for n in lengths:
            ref = hf(input_ids=ids[None, start : start + n]).logits[0]
            diffs.append((packed[start : start + n] - ref).abs().max())
            start += n
    return float(torch.stack(diffs).max())


def test_packed_logits_match_transformers_per_sequence(pair):
    _, hf, ours = pair
    assert _max_diff_per_sequence(hf, ours, LENGTHS) <= 1e-4


def test_loss_and_grads_match_transformers(pair):
    _, hf, ours = pair
    assert_loss_and_grads_match(hf, ours, _ids(12, seed=2))


def test_window_is_set_and_off_by_one_fails(pair):
    name, hf, ours = pair
    windows = [layer.self_attn.window for layer in ours.model.layers]
    expected = {
        "qwen2-window-layer1": [None, WINDOW],
        "mistral-window": [WINDOW, WINDOW],
        "phi3-window": [WINDOW, WINDOW],
    }.get(name, [None, None])
    assert windows == expected
    if WINDOW not in windows:
        return
    for wrong in (WINDOW - 1, WINDOW + 1):
        off = copy.deepcopy(ours)
        for layer in off.model.layers:
            if layer.self_attn.window is not None:
                layer.self_attn.window = wrong
        assert _max_diff_per_sequence(hf, off, LENGTHS) > 1e-3, wrong


@pytest.fixture(scope="module")
def lora_pair(pair):
    """(name, hf, ours with all-linear LoRA and nonzero B factors)."""
    name, hf, ours = pair
    model = slipstream.apply_lora(copy.deepcopy(ours), rank=4, alpha=8, targets="all-linear")
    with torch.no_grad():  # a trained adapter: B != 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    return name, hf, model


def test_lora_adapter_loads_in_peft_with_same_logits(lora_pair, tmp_path):
    from peft import PeftModel

    name, hf, model = lora_pair
    slipstream.save_adapter(model, tmp_path)
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(model.lora_config["target_modules"]) == (fused if "phi3" in name else split)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert _max_diff_per_sequence(peft_model, model, LENGTHS) <= 1e-4
    assert _max_diff_per_sequence(hf, model, LENGTHS) > 1e-3  # the adapter mattered


def test_export_merged_loads_in_transformers(lora_pair, tmp_path):
    import transformers

    _, _, model = lora_pair
    ids, seq = _ids(12), SeqInfo.from_lengths([12])
    with torch.no_grad():
        expected = model(ids, seq)
    slipstream.export_merged(copy.deepcopy(model), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        got = back(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_lora_training_step_has_no_host_syncs(lora_pair):
    from slipstream.train.optim import build_optimizer

    _, _, model = lora_pair
    model = copy.deepcopy(model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    # device=cuda: the optimizer the trainer builds on a GPU (fused AdamW), without one.
    optimizer = build_optimizer(
        model.named_parameters(), lr=1e-3, weight_decay=0.0, device=torch.device("cuda")
    )
    ids, seq = _ids(sum(LENGTHS)), SeqInfo.from_lengths(LENGTHS)
    labels = shifted_labels(ids, LENGTHS)
    for _ in range(2):  # the first step creates the optimizer state; audit the second
        with slipstream.count_syncs() as syncs:
            loss = model.loss(ids, labels, seq, reduction="sum") / sum(n - 1 for n in LENGTHS)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert syncs.total == 0, str(syncs)


# ------------------------------------------------------------------- config rules


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        dict(use_sliding_window=False, sliding_window=4, max_window_layers=0),
        dict(sliding_window=4, max_window_layers=0),  # no use_sliding_window key: false
        dict(sliding_window=4, layer_types=["sliding_attention"] * 3),
        dict(
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ],
)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_layer_windows_follow_transformers(overrides, family):
    """A config.json as transformers 4 wrote it (no layer_types) or as 5 writes it; Qwen3's
    rule is Qwen2's (a config without use_sliding_window has no windows)."""
    import transformers

    from slipstream.models import family_for

    raw = {**LLAMA_BASE, "num_hidden_layers": 3, "model_type": family, **overrides}
    ref = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family](**raw)
    expected = [ref.sliding_window if t == "sliding_attention" else None for t in ref.layer_types]
    module = family_for(family)
    assert module.layer_windows(module.config_from_hf(raw)) == expected


@pytest.mark.parametrize("lengths", [[3, 8, 5], [12, 9]], ids=["all-short", "all-long"])
def test_phi3_longrope_uniform_batches(lengths, tmp_path):
    """Batches wholly on one side of original_max_position_embeddings (no per-token blend)."""
    hf = _hf_model("phi3", **CASES["phi3-partial-longrope"][1])
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path)
    assert _max_diff_per_sequence(hf, ours, lengths) <= 1e-4
    if lengths == [12, 9]:  # the long factors mattered: short ones give other logits
        ours.model.long_inv_freq.copy_(ours.model.inv_freq)
        assert _max_diff_per_sequence(hf, ours, lengths) > 1e-3


PHI3_RAW = {**LLAMA_BASE, "model_type": "phi3", "max_position_embeddings": 64}


@pytest.mark.parametrize(
    "hf,match",
    [
        (
            {**PHI3_RAW, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope type 'dynamic' is not supported for phi3",
        ),
        (
            {**PHI3_RAW, "rope_scaling": {**LONGROPE, "short_factor": [1.0]}},
            "rope short_factor must be a list of 4 numbers",
        ),
        ({**PHI3_RAW, "partial_rotary_factor": 0.4}, "partial_rotary_factor=0.4 gives 3"),
        ({**PHI3_RAW, "sliding_window": 0}, "sliding_window=0 must be a positive integer"),
        (
            {**LLAMA_BASE, "model_type": "mistral", "sliding_window": -1},
            "sliding_window=-1 must be a positive integer",
        ),
        (
            {**LLAMA_BASE, "model_type": "qwen2", "layer_types": ["full_attention"]},
            "layer_types has 1 entries but num_hidden_layers is 2",
        ),
    ],
)
def test_config_errors_are_one_line(hf, match):
    from slipstream.models import family_for

    with pytest.raises(ValueError, match=match) as e:
        family_for(hf["model_type"]).config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_phi4_mini_rope_matches_transformers_longrope():
    """Phi-4-mini's real shapes (config.json as published: transformers 4 keys, partial rotary
    0.75 at the top level, 48 factors): our frequencies and scale equal transformers'."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from slipstream.models import phi3

    g = torch.Generator().manual_seed(0)
    short, long = (
        (1 + 3 * torch.rand(48, generator=g)).tolist(),
        (1 + 40 * torch.rand(48, generator=g)).tolist(),
    )
    raw = dict(
        model_type="phi3",
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        sliding_window=262144,
        tie_word_embeddings=True,
        pad_token_id=None,
        rope_scaling=dict(type="longrope", short_factor=short, long_factor=long),
    )
    rope = phi3.Phi3Rope.from_hf(raw)
    ref = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    ref_short, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](ref)
    ref_long, _ = ROPE_INIT_FUNCTIONS["longrope"](ref, seq_len=4097)
    assert rope.rotary_dim == 96 and rope.original_max == 4096
    assert rope.attention_factor == pytest.approx(ref_scale, rel=1e-12)
    torch.testing.assert_close(rope.inv_freq(rope.short_factor), ref_short, atol=0, rtol=1e-6)
    torch.testing.assert_close(rope.inv_freq(rope.long_factor), ref_long, atol=0, rtol=1e-6)
    with torch.device("meta"):
        model = phi3.build(phi3.config_from_hf(raw))
    attn = model.model.layers[0].self_attn
    assert tuple(attn.qkv_proj.weight.shape) == ((24 + 2 * 8) * 128, 3072)
    assert attn.window == 262144 and not hasattr(model, "lm_head")
