"""FP8 checkpoints (checkpoint/fp8.py): block-wise float8_e4m3fn weights with
`weight_scale_inv`, dequantised while they load. Our dequantisation equals transformers'
`Fp8Dequantize` bit for bit; a tiny FP8 checkpoint loads (native families and transformers'
modeling code, dense and MoE) to the weights and logits of transformers' own FP8 loader; a
LoRA run on it gives an adapter peft loads on transformers' model; what cannot load stops in
one line before a weight does."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers.fp8 import quantize_blocks, to_fp8
from helpers.models import make_hf_model
from helpers.moe_models import make_hf_moe_model
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny

from slipstream.checkpoint import fp8 as fp8_module
from slipstream.checkpoint.fp8 import dequantize_fp8
from slipstream.checkpoint.hf import load_model
from slipstream.ops.packing import SeqInfo

IDS = torch.tensor([1, 17, 42, 5, 90, 23, 7, 64, 3, 11])


def transformers_dequantize(q, scale, dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=dtype)


def transformers_model(folder, image_text: bool = False):
    """transformers' from_pretrained of an FP8 folder: on a machine without CUDA its FP8
    quantizer dequantises every weight to the model's dtype (float32 here)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, block", [((48, 80), (16, 16)), ((3, 32, 64), (16, 32)), ((40, 24), (8, 24))]
)
def test_dequantize_equals_transformers(shape, block, dtype, monkeypatch):
    """Dense and stacked (E, R, C) weights, bf16 and float32 results, float32 and bf16 scales,
    computed a few block rows at a time (CHUNK shrunk so a weight takes several chunks)."""
    torch.manual_seed(0)
    q, s = quantize_blocks(torch.randn(shape) * 3, *block)
    monkeypatch.setattr(fp8_module, "CHUNK", block[0] * shape[-1] * 2)
    for scale in (s, s.bfloat16()):
        got = dequantize_fp8(q, scale, dtype)
        want = transformers_dequantize(q, scale, dtype)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    ue8m0 = torch.randint(120, 130, s.shape, dtype=torch.uint8)  # power-of-two scales
    assert torch.equal(dequantize_fp8(q, ue8m0, dtype), transformers_dequantize(q, ue8m0, dtype))
    one = torch.tensor(0.01)  # one scale for the whole tensor
    assert torch.equal(dequantize_fp8(q, one, dtype), transformers_dequantize(q, one, dtype))
    # and it is the right number: within e4m3's rounding (3 mantissa bits) of the original
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    assert ((dequantize_fp8(q, s, torch.float32) - w).abs() <= w.abs() / 16 + 1e-2).all()


def _weights_equal(ours, theirs) -> None:
    """Every parameter of ours equals transformers' parameter of that name (native families
    keep transformers' names where the structure matches: stacked experts too)."""
    want = dict(theirs.named_parameters())
    state = dict(ours.named_parameters())
    assert state.keys() <= want.keys(), sorted(state.keys() - want.keys())[:3]
    for name, t in state.items():
        assert torch.equal(t, want[name]), name


def _logits_equal(folder, implementation="auto", image_text=False):
    theirs = transformers_model(folder, image_text)
    ours = load_model(folder, dtype=torch.float32, implementation=implementation).eval()
    fp8, count = ours.base_quantization.split(": ")
    assert fp8 == "FP8 (16x16 blocks)" and int(count.split()[0]) > 0
    _weights_equal(ours, theirs)
    with torch.no_grad():
        want = theirs(input_ids=IDS[None]).logits[0]
        got = ours(IDS, SeqInfo.from_lengths([len(IDS)]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return ours, theirs


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_llama_loads_as_transformers_dequantises(tmp_path, quiet, implementation):  # noqa: F811
    """A dense FP8 Llama, native family and transformers' modeling code: weights equal
    transformers' dequantised model's exactly, logits to 1e-5, no quantization left on it."""
    make_hf_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  initializer_range=0.2).save_pretrained(tmp_path)  # fmt: skip
    ours, _ = _logits_equal(to_fp8(tmp_path), implementation)
    assert "quantization_config" not in ours.config.hf
    native = implementation == "auto"
    assert ours.load_path.startswith("llama: native" if native else "llama: transformers'")


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_qwen3_moe_experts_load_as_transformers_dequantises(tmp_path, quiet, implementation):  # noqa: F811
    """Per-expert FP8 tensors (as Qwen3-30B-A3B-FP8 stores them) into the stacked experts of
    our native family and of transformers' model (its per-expert -> stacked conversion)."""
    make_hf_moe_model("qwen3_moe", moe_intermediate_size=32).save_pretrained(tmp_path)
    ours, theirs = _logits_equal(to_fp8(tmp_path), implementation)
    want = theirs.model.layers[1].mlp.experts.gate_up_proj
    got = dict(ours.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(got, want)


def test_stacked_fp8_experts_keep_their_layout(tmp_path, quiet):  # noqa: F811
    """A checkpoint that stores the experts stacked (`experts.gate_up_proj (E, 2I, D)` with
    `experts.gate_up_proj_scale_inv (E, 2I/16, D/16)`) loads into the native family as the
    per-expert FP8 checkpoint of the same blocks does."""
    from safetensors.torch import load_file, save_file

    make_hf_moe_model("qwen3_moe", moe_intermediate_size=32).save_pretrained(tmp_path / "per")
    state = load_file(tmp_path / "per" / "model.safetensors")
    stacked = {k: v for k, v in state.items() if ".experts." not in k}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        for proj, parts in [
            ("gate_up_proj", ("gate_proj", "up_proj")),
            ("down_proj", ("down_proj",)),
        ]:
            stacked[f"{prefix}.{proj}"] = torch.stack([
                torch.cat([state[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in range(8)
            ])  # fmt: skip
    (tmp_path / "stacked").mkdir()
    save_file(stacked, tmp_path / "stacked" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "stacked" / "config.json").write_text(
        (tmp_path / "per" / "config.json").read_text()
    )
    per = load_model(to_fp8(tmp_path / "per"), dtype=torch.float32)
    ours = load_model(to_fp8(tmp_path / "stacked"), dtype=torch.float32)
    # 2 layers x (q, k, v, o + the two stacked expert tensors)
    assert ours.base_quantization.endswith(": 12 weights dequantised to float32")
    want = dict(per.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, want[name]), name


def test_olmo2_generic_loads_as_transformers_dequantises(tmp_path, quiet):  # noqa: F811
    """A type without a native family (OLMo 2: transformers' modeling code); its save is a
    float32 checkpoint (transformers' save_pretrained does not re-quantise it)."""
    from safetensors import safe_open

    from slipstream.checkpoint.hf import save_model

    ours, theirs = _logits_equal(to_fp8(save_tiny(tmp_path / "fp8", "olmo2")))
    save_model(ours, tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved/config.json").read_text())
    with safe_open(tmp_path / "saved/model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # noqa: SIM118
    with torch.no_grad():
        want = theirs(input_ids=IDS[None]).logits[0]
        got = transformers_model(tmp_path / "saved")(input_ids=IDS[None]).logits[0]
    assert torch.equal(got, want)


def test_ministral3_image_text_loads_as_transformers_dequantises(tmp_path, quiet):  # noqa: F811
    """Mistral 3 with a Ministral 3 language model (transformers' image-text modeling code),
    its language model FP8 and its vision tower not, as Ministral 3's FP8 checkpoints are."""
    from helpers.tiny_vlm import ministral3_text, vlm_folder

    folder = ministral3_text(vlm_folder(tmp_path, "mistral3"))
    ours, theirs = _logits_equal(to_fp8(folder, within="language_model."), image_text=True)
    assert ours.load_path.startswith("mistral3: transformers'")


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """(FP8 model folder, train.jsonl): the trainer tests' tiny Llama run, its decoder
    projections FP8 in 16x16 blocks."""
    from helpers.runs import make_tiny_run

    model_dir, data = make_tiny_run(tmp_path_factory.mktemp("fp8_run"))
    return to_fp8(model_dir), data


def test_lora_run_on_fp8_then_peft_and_export(fp8_run, tmp_path, capsys, quiet):  # noqa: F811
    """`slipstream train` (LoRA, 2 steps) on the FP8 folder; its adapter names the FP8 folder
    as its base and loads in peft on transformers' FP8-loaded model with our logits; `export`
    writes a float32 model without a quantization_config, says the base was FP8, and
    transformers loads it to the adapter's logits."""
    import yaml
    from helpers.runs import assert_adapter_loads_in_peft, lora_run_config

    from slipstream import cli

    out, merged = tmp_path / "run", tmp_path / "merged"
    raw = lora_run_config(fp8_run, out, steps=2)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    assert "completed at step 2" in capsys.readouterr().out
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(fp8_run[0])
    assert_adapter_loads_in_peft(fp8_run[0], out)

    assert cli.main(["export", str(out), "--out", str(merged)]) == 0
    said = capsys.readouterr().out
    assert "base was FP8 (16x16 blocks)" in said and "not re-quantised" in said
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    summary = json.loads((merged / "export_summary.json").read_text())
    assert summary["base_dequantized_from_fp8"].startswith("FP8 (16x16 blocks): 14 weights")
    import peft

    hf = transformers_model(merged)
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    theirs = peft.PeftModel.from_pretrained(transformers_model(fp8_run[0]), out).eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS[None]).logits[0]
        torch.testing.assert_close(hf(input_ids=IDS[None]).logits[0], want, rtol=1e-5, atol=1e-5)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("slipstream: error: "), err
    return err


def test_unsupported_quant_method_exits_2_in_one_line(fp8_run, tmp_path, capsys):
    """A quant_method we do not load (GPTQ here): one line, exit 2, before a weight loads."""
    import shutil

    import yaml
    from helpers.runs import lora_run_config

    from slipstream import cli

    folder = tmp_path / "gptq"
    shutil.copytree(fp8_run[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    raw = lora_run_config((folder, fp8_run[1]), tmp_path / "out", steps=2)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    err = _error(capsys)
    assert "quantization_config.quant_method 'gptq' is not supported" in err
    assert "unquantised (bf16) checkpoint" in err
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        load_model(folder)


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_a_block_that_does_not_tile_is_refused_before_a_weight_loads(
    fp8_run, tmp_path, monkeypatch, implementation
):
    """config.json's block does not tile a weight (24x24 blocks of a 32 x 64 down_proj), or
    is not the one its scales were made with (32x32): one line naming the tensor, from the
    safetensors headers alone (no tensor is read)."""
    import shutil

    from slipstream.checkpoint import hf

    folder = tmp_path / "fp8"
    shutil.copytree(fp8_run[0], folder)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read")
        yield

    monkeypatch.setattr(hf, "_safetensors_tensors", no_reads)
    config = json.loads((folder / "config.json").read_text())
    for block, why in [(24, "the block does not tile it"), (32, "its scales are (2, 4), not")]:
        config["quantization_config"]["weight_block_size"] = [block, block]
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as e:
            load_model(folder, implementation=implementation)
        msg = str(e.value)
        assert "\n" not in msg and f"weight_block_size [{block}, {block}]: {why}" in msg
        assert "'model.layers.0.mlp.down_proj.weight' (32, 64)" in msg


def test_nf4_on_fp8_quantises_the_dequantised_weights(fp8_run, quiet):  # noqa: F811
    """model.quantization=nf4 on an FP8 checkpoint, native family: each weight dequantised,
    then quantised to NF4 as it loads (equal to NF4 of transformers' dequantised weight);
    on transformers' modeling code: refused in one line."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from slipstream.peft.qlora import NF4, dequantize_weight

    theirs = dict(transformers_model(fp8_run[0]).named_parameters())
    ours = load_model(fp8_run[0], dtype=torch.float32, quantize="nf4")
    layers = [(n, m) for n, m in ours.named_modules() if type(m).__name__ == "Linear4bit"]
    assert len(layers) == 14
    for name, module in layers:
        packed, state = quantize_4bit(theirs[f"{name}.weight"], quant_storage=torch.uint8, **NF4)
        assert torch.equal(dequantize_weight(module), dequantize_4bit(packed, state)), name
    with pytest.raises(ValueError, match="nf4 on an FP8 checkpoint runs on native families"):
        load_model(fp8_run[0], quantize="nf4", implementation="transformers")
