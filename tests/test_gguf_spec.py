"""Each family's GGUF spec: every tensor transform undone by its inverse, the row flag only on
row permutations (what a GGUF LoRA's B relies on), the names the gguf package knows."""

import types

import pytest
import torch

from slipstream.checkpoint.gguf_families import BY_ARCH, BY_MODEL_TYPE, QWEN3MOE, SPECS
from slipstream.checkpoint.gguf_spec import FUSED_EXPERTS, IMAGE_TEXT_LM

gguf = pytest.importorskip("gguf")

CFG = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
SHAPES = {  # a tensor shape for each suffix a transform names (heads of 6 dims, E = 3)
    "q_proj.weight": (24, 10), "q_proj.bias": (24,), "k_proj.weight": (12, 10),
    "k_proj.bias": (12,), "norm.weight": (10,), "self_attn.sinks": (4,),
    "mlp.experts.gate_up_proj": (3, 10, 8), "mlp.experts.gate_up_proj_bias": (3, 8),
    "mlp.experts.down_proj": (3, 4, 10), "mlp.experts.down_proj_bias": (3, 10),
    "mlp.experts.gate_proj.weight": (3, 4, 10), "mlp.experts.up_proj.weight": (3, 4, 10),
    "mlp.experts.down_proj.weight": (3, 10, 4),
}  # fmt: skip


def _cases(spec):
    for tr in (*spec.transforms, *FUSED_EXPERTS):
        for suffix in tr.suffixes:
            yield (
                tr,
                f"model.layers.1.{suffix}",
                torch.randn(SHAPES[suffix]),
            )  # float32, as import reads


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_transform_is_undone_by_its_inverse(spec):
    for tr, name, t in _cases(spec):
        parts = [x for _, x in tr.to_llama_cpp(CFG, name, t)]
        back = list(tr.to_hf(CFG, name, parts))
        if tr in QWEN3MOE.transforms:  # one stacked tensor back to one per expert, hub names
            prefix, _, proj = name.removesuffix(".weight").rpartition(".")
            assert [n for n, _ in back] == [f"{prefix}.{e}.{proj}.weight" for e in range(3)]
            back = [(name, torch.stack([x for _, x in back]))]
        assert [n for n, _ in back] == [name]
        torch.testing.assert_close(back[0][1], t, rtol=0, atol=1e-6, msg=name)
        assert spec.transform(name) is tr or tr in FUSED_EXPERTS  # a family's own rule first


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_row_transforms_commute_with_lora_b(spec):
    """For a `rows` transform, exporting W + B @ A equals lora_b(B) @ A added to W's export:
    what llama.cpp computes from a GGUF LoRA."""
    for tr, name, t in _cases(spec):
        if not tr.rows:
            continue
        b, a = torch.randn(t.shape[0], 3, dtype=t.dtype), torch.randn(3, 10, dtype=t.dtype)
        module = name.removesuffix(".weight")
        if name.endswith(".weight"):
            merged = tr.to_llama_cpp(CFG, name, b @ a)[0][1]
            torch.testing.assert_close(spec.lora_b(CFG, module, b) @ a, merged)
    b = torch.randn(24, 3)
    moved = spec.lora_b(CFG, "model.layers.0.self_attn.q_proj", b)
    assert torch.equal(moved, b) == (spec.name != "llama")  # only llama permutes Q/K rows


def test_specs_name_what_the_gguf_package_and_our_families_know():
    from slipstream.models import FAMILIES

    for spec in SPECS:
        assert gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[spec.arch]] == spec.name
        assert BY_ARCH[spec.name] is spec and spec.model_type in FAMILIES
    # a native family, or an image-text type whose language model exports alone (mistral3)
    assert set(BY_MODEL_TYPE) <= set(FAMILIES) | set(IMAGE_TEXT_LM)
