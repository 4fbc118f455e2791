"""Adapters made by peft 0.21 itself, in every spelling of its targets, load here with peft's
matches, ranks and logits (float32, 1e-5): all-linear (a small model's is saved with full
module paths), short names, full paths, a regex, exclude_modules, layers_to_transform (+
layers_pattern), rank_pattern / alpha_pattern, expert target_parameters; the image+text Gemma 3
layout; what slipstream cannot represent is a one-line error naming the key; the CLI paths."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from helpers.models import make_hf_model, randomise_lora_b
from helpers.moe_models import make_hf_moe_model
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper

import slipstream
from slipstream import cli
from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.ops.packing import SeqInfo
from slipstream.peft.matching import model_targets
from slipstream.peft.names import model_layout, peft_path

N = 12  # tokens of the one test sequence


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its save_pretrained folder), built on first use."""
    made = {}

    def get(family: str):
        if family not in made:
            moe = family in ("qwen3_moe", "gpt_oss")
            hf = make_hf_moe_model(family, seed=3) if moe else make_hf_model(family, seed=3)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            made[family] = hf, path
        return made[family]

    return get


def _peft_made(hf, out, **config):
    """peft's own adapter on `hf` (B random, as trained), saved to `out`; the PeftModel."""
    config = {"r": 2, "lora_alpha": 4, **config}
    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(**config))
    randomise_lora_b(pm)
    pm.save_pretrained(out)
    return pm.eval()


def _peft_wrapped(pm) -> dict[str, tuple[int, float]]:
    """transformers path -> (r, alpha) of every module and parameter peft put LoRA on."""
    found = {}
    for name, m in pm.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        path = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(m, ParamWrapper):
            path = f"{path}.{m.parameter_name}"
        found[path] = (m.r["default"], m.lora_alpha["default"])
    return found


def _our_wrapped(model) -> dict[str, tuple[int, float]]:
    layout, targets = model_layout(model), model_targets(model)
    found = {peft_path(n, layout): ra for n, ra in targets.linears.items()}
    found.update({f"{peft_path(n, layout)}.weight": ra for n, ra in targets.routers.items()})
    for path, params in targets.experts.items():
        found.update({f"{peft_path(path, layout)}.{t}": ra for t, ra in params.items()})
    return found


def _ids(vocab: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(1, vocab, (N,), generator=torch.Generator().manual_seed(seed))


def _assert_same_as_peft(pm, ours, vocab: int, base=None) -> None:
    """Same targets and ranks as peft; logits within 1e-5; and the adapter matters."""
    assert _our_wrapped(ours) == _peft_wrapped(pm)
    ids = _ids(vocab)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths([N]))
        expected = pm(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        if base is not None:
            assert (base(input_ids=ids[None]).logits[0] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"])
def test_all_linear_saved_with_full_paths(checkpoints, tmp_path, family):
    hf, path = checkpoints(family)
    pm = _peft_made(hf, tmp_path, target_modules="all-linear")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
    assert all(t.startswith("model.layers.") for t in saved)  # the spelling that failed
    ours = load_adapter(slipstream.load_model(path), tmp_path)
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)


SPELLINGS = {
    "short-names": ("qwen2", dict(target_modules=["q_proj", "v_proj", "down_proj"])),
    "full-paths": (
        "mistral",
        dict(target_modules=["model.layers.1.self_attn.q_proj", "model.layers.0.mlp.up_proj"]),
    ),
    "suffix-paths": ("llama", dict(target_modules=["self_attn.k_proj", "1.mlp.gate_proj"])),
    "regex": ("llama", dict(target_modules=r"model\.layers\.1\.self_attn\.(q|k|o)_proj")),
    "exclude-list": (
        "qwen3",
        dict(
            target_modules="all-linear", exclude_modules=["o_proj", "model.layers.0.mlp.down_proj"]
        ),
    ),
    "exclude-regex": (
        "phi3",
        dict(target_modules=["qkv_proj", "gate_up_proj"], exclude_modules=r".*\.0\.mlp\..*"),
    ),
    "layers-to-transform": (
        "gemma3_text",
        dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1]),
    ),
    "layers-pattern": (
        "llama",
        dict(target_modules=["v_proj", "up_proj"], layers_to_transform=0, layers_pattern="layers"),
    ),
    "rank-alpha-pattern": (
        "qwen3",
        dict(
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"q_proj": 5, r"model\.layers\.1\.mlp\.down_proj": 3},
            alpha_pattern={r"layers\.0\.self_attn\.v_proj": 11, "down_proj": 7},
            use_rslora=True,
        ),
    ),
    "rank-pattern-dora": (
        "llama",
        dict(target_modules=["k_proj", "o_proj"], rank_pattern={"o_proj": 3}, use_dora=True),
    ),
}


@pytest.mark.parametrize("family,config", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_each_spelling_matches_peft(checkpoints, tmp_path, family, config):
    hf, path = checkpoints(family)
    pm = _peft_made(hf, tmp_path / "peft", **config)
    ours = load_adapter(slipstream.load_model(path), tmp_path / "peft")
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)
    # Our save of it wraps the same modules, ranks and alphas in peft, and loads back here.
    save_adapter(ours, tmp_path / "ours", base_model_name_or_path=str(path))
    again = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    _assert_same_as_peft(again, ours, hf.config.vocab_size)
    back = load_adapter(slipstream.load_model(path), tmp_path / "ours")
    assert _our_wrapped(back) == _our_wrapped(ours)


def test_long_path_list_with_layers_to_transform(tmp_path):
    """21 full paths (peft saves them cut; here as a user wrote them): peft cuts them to
    suffixes when it loads, so layers_to_transform applies (an exact path match would not
    look at the layer)."""
    hf = make_hf_model("llama", seed=4, num_hidden_layers=3)
    hf.save_pretrained(tmp_path / "model")
    paths = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)][:-1]
    assert len(paths) == 21
    _peft_made(hf, tmp_path / "peft", target_modules=paths, layers_to_transform=[1])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert len(config["target_modules"]) < 21
    config["target_modules"] = paths
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    pm = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "peft").eval()
    ours = load_adapter(slipstream.load_model(tmp_path / "model"), tmp_path / "peft")
    assert {p.split(".")[2] for p in _our_wrapped(ours)} == {"1"}
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)


def test_gemma3_image_text_layout_full_paths_and_patterns(tmp_path):
    """Full paths under `model.language_model.`, an exclude and a rank pattern, as peft; a
    short name (q_proj) reaches the vision tower too, which our model holds."""
    from test_gemma3_multimodal import make_multimodal

    hf = make_multimodal(seed=2)
    hf.save_pretrained(tmp_path / "model")
    lm = "model.language_model.layers"
    config = dict(
        target_modules=[f"{lm}.2.mlp.down_proj", "o_proj", "q_proj"],
        exclude_modules=[f"{lm}.1.self_attn.o_proj"],
        rank_pattern={rf"{re.escape(lm)}\.2\..*": 3},
    )
    pm = _peft_made(hf, tmp_path / "peft", **config)
    assert any("vision" in p for p in _peft_wrapped(pm))  # q_proj: the vision tower's too
    ours = load_adapter(slipstream.load_model(tmp_path / "model"), tmp_path / "peft")
    assert any(p.startswith("model.vision_tower.") for p in _our_wrapped(ours))
    _assert_same_as_peft(pm, ours, hf.config.text_config.vocab_size)
    config["target_modules"][2] = f"{lm}.0.self_attn.q_proj"
    pm = _peft_made(hf, tmp_path / "peft2", **config)
    ours = load_adapter(slipstream.load_model(tmp_path / "model"), tmp_path / "peft2")
    assert sorted(_our_wrapped(ours)) == [
        f"{lm}.0.self_attn.o_proj", f"{lm}.0.self_attn.q_proj", f"{lm}.2.mlp.down_proj",
        f"{lm}.2.self_attn.o_proj",
    ]  # fmt: skip
    _assert_same_as_peft(pm, ours, hf.config.text_config.vocab_size)


MOE = {
    "qwen3_moe-v4-names": (  # peft rewrites them to the fused experts, twice the rank there
        "qwen3_moe",
        dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
    "qwen3_moe-paths-and-patterns": (
        "qwen3_moe",
        dict(
            target_modules=["k_proj"],
            target_parameters=["model.layers.1.mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"down_proj": 3},
            alpha_pattern={r"model\.layers\.0\.mlp\.experts\.down_proj": 5},
        ),
    ),
    "gpt_oss-all-linear-experts": (
        "gpt_oss",
        dict(
            target_modules="all-linear",
            target_parameters=["mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"],
            rank_pattern={"gate_up_proj": 3},
        ),
    ),
}


@pytest.mark.parametrize("family,config", MOE.values(), ids=MOE.keys())
def test_expert_target_parameters_match_peft(checkpoints, tmp_path, family, config):
    hf, path = checkpoints(family)
    pm = _peft_made(hf, tmp_path / "peft", **config)
    assert any(isinstance(m, ParamWrapper) for m in pm.modules())
    ours = load_adapter(slipstream.load_model(path), tmp_path / "peft")
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)
    save_adapter(ours, tmp_path / "ours", base_model_name_or_path=str(path))
    again = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    _assert_same_as_peft(again, ours, hf.config.vocab_size)


def test_qwen3_moe_all_linear_with_router_lora(checkpoints, tmp_path):
    """peft 0.21's all-linear on Qwen3-MoE: q/k/v/o, both expert parameters (gate_up_proj at
    twice the rank) and the router's weight (`gate.weight`); a router bias is refused."""
    hf, path = checkpoints("qwen3_moe")
    pm = _peft_made(hf, tmp_path / "peft", target_modules="all-linear")
    assert "model.layers.0.mlp.gate.weight" in _peft_wrapped(pm)
    ours = load_adapter(slipstream.load_model(path), tmp_path / "peft")
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)
    save_adapter(ours, tmp_path / "ours", base_model_name_or_path=str(path))
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert "mlp.gate.weight" in saved["target_parameters"]
    again = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    _assert_same_as_peft(again, ours, hf.config.vocab_size)
    ids, seq = _ids(hf.config.vocab_size), SeqInfo.from_lengths([N])
    with torch.no_grad():
        want = ours(ids, seq)
        merged = slipstream.merge_lora(ours)
        torch.testing.assert_close(merged(ids, seq), want, atol=1e-5, rtol=1e-5)

    hf, path = checkpoints("gpt_oss")
    _peft_made(hf, tmp_path / "bias", target_modules=["q_proj"])
    cfg = json.loads((tmp_path / "bias" / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.router.bias"]
    (tmp_path / "bias" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"target_parameters matches .*mlp\.router\.bias") as e:
        load_adapter(slipstream.load_model(path), tmp_path / "bias")
    assert "\n" not in str(e.value)


def test_gpt_oss_router_weight(checkpoints, tmp_path):
    hf, path = checkpoints("gpt_oss")
    pm = _peft_made(
        hf,
        tmp_path,
        target_modules=["v_proj"],
        target_parameters=["model.layers.1.mlp.router.weight", "mlp.experts.down_proj"],
        rank_pattern={"router.weight": 3},
    )
    ours = load_adapter(slipstream.load_model(path), tmp_path)
    _assert_same_as_peft(pm, ours, hf.config.vocab_size, base=hf)
    save_adapter(ours, tmp_path / "ours", base_model_name_or_path=str(path))
    again = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    _assert_same_as_peft(again, ours, hf.config.vocab_size)


EMBEDDINGS = {
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "trainable_token_indices": dict(target_modules=["q_proj"], trainable_token_indices=[3, 5]),
}


@pytest.mark.parametrize("key,config", EMBEDDINGS.items(), ids=EMBEDDINGS.keys())
def test_peft_trained_embeddings_load_into_ours(checkpoints, tmp_path, key, config):
    """peft's own trained head / token rows (moved from their start) give its logits here."""
    hf, path = checkpoints("llama")
    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=2, lora_alpha=4, **config))
    randomise_lora_b(pm)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "modules_to_save" in name or "trainable_tokens_delta" in name:
                p.add_(0.5 * torch.randn_like(p))
    pm.save_pretrained(tmp_path)
    ours = load_adapter(slipstream.load_model(path), tmp_path)
    _assert_same_as_peft(pm.eval(), ours, hf.config.vocab_size, base=hf)


UNSUPPORTED = {
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["v_proj"]),
    "layer_replication": dict(target_modules=["q_proj"], layer_replication=[[0, 2], [1, 2]]),
}


@pytest.mark.parametrize("key,config", UNSUPPORTED.items(), ids=UNSUPPORTED.keys())
def test_what_slipstream_cannot_represent_is_a_one_line_error(checkpoints, tmp_path, key, config):
    hf, path = checkpoints("llama")
    _peft_made(hf, tmp_path, **config)
    with pytest.raises(ValueError, match=rf"adapter_config.json: {key}=.* is not supported") as e:
        load_adapter(slipstream.load_model(path), tmp_path)
    assert "\n" not in str(e.value)


def test_hand_written_configs(checkpoints, tmp_path):
    """What peft would refuse or never writes: one line each; a literal "all-linear" works."""
    hf, path = checkpoints("llama")
    pm = _peft_made(hf, tmp_path, target_modules="all-linear")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cases = {
        "init_lora_weights='pissa' is not supported": {"init_lora_weights": "pissa"},
        "bias='all' is not supported": {"bias": "all"},
        "layers_pattern is set but layers_to_transform is not": {"layers_pattern": "layers"},
        "layers_to_transform needs a list": {
            "target_modules": ".*q_proj",
            "layers_to_transform": [0],
        },
        r"matches model\.layers\.0\.mlp, a": {"target_modules": r"model\.layers\.0\.mlp"},
        r"\['nope'\] match no nn.Linear": {"target_modules": ["nope"]},
        "no valid regex": {"exclude_modules": "(("},
    }
    for message, change in cases.items():
        (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message) as e:
            load_adapter(slipstream.load_model(path), tmp_path)
        assert "\n" not in str(e.value)
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({**cfg, "target_modules": "ALL-LINEAR"})
    )
    _assert_same_as_peft(pm, load_adapter(slipstream.load_model(path), tmp_path), 97)


def test_cli_train_from_a_peft_all_linear_adapter(tiny_run, tmp_path, capsys):
    """SFT with peft, then `slipstream train` from its adapter (the run that exited 2);
    `slipstream export` of the peft adapter gives peft's merged model, and `slipstream
    generate` on it the merged model's greedy completion."""
    import transformers
    import yaml
    from helpers.runs import run_config

    model_dir, _ = tiny_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    pm = _peft_made(hf, tmp_path / "peft", target_modules="all-linear", r=4, lora_alpha=8)
    raw = run_config(tiny_run, tmp_path / "out", steps=2)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {}
    raw["model"]["adapter"] = str(tmp_path / "peft")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    trained = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "out")
    assert trained.peft_config["default"].r == 4 and len(_peft_wrapped(trained)) == 14

    merged = tmp_path / "merged"
    args = ["export", str(tmp_path / "peft"), "--base", str(model_dir), "--out", str(merged)]
    assert cli.main(args) == 0
    ids = _ids(300)[None]
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(merged).float()(input_ids=ids)
        torch.testing.assert_close(got.logits, pm(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    for src in (merged, tmp_path / "peft"):
        capsys.readouterr()
        args = ["generate", str(src), "What color is the sky?", "--max-new-tokens", "6"]
        assert cli.main([*args, "--device", "cpu"]) == 0
        out = capsys.readouterr().out
        if src == merged:
            expected = out
    assert out == expected and out.strip()


def test_gguf_lora_keeps_per_target_ranks_and_alphas(tiny_run, tmp_path):
    """llama.cpp's one alpha over each matrix's rank gives peft's delta for every target."""
    import transformers
    from gguf import GGUFReader

    from slipstream.checkpoint.gguf_lora import export_adapter_gguf

    model_dir, _ = tiny_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    config = dict(
        target_modules=["v_proj", "o_proj", "down_proj"],
        rank_pattern={"v_proj": 3},
        alpha_pattern={r"layers\.1\.mlp\.down_proj": 10},
        use_rslora=True,
    )
    pm = _peft_made(hf, tmp_path / "peft", **config)
    path = export_adapter_gguf(tmp_path / "peft", tmp_path / "lora.gguf", base=str(model_dir))
    reader = GGUFReader(str(path))
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    ab = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    gguf_of = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output"}
    gguf_of["mlp.down_proj"] = "ffn_down"
    checked = 0
    for i, layer in enumerate(pm.base_model.model.model.layers):
        for name, short in gguf_of.items():
            m = layer.get_submodule(name)
            want = m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight
            a, b = ab[f"blk.{i}.{short}.weight.lora_a"], ab[f"blk.{i}.{short}.weight.lora_b"]
            torch.testing.assert_close(alpha / a.shape[0] * (b @ a), want.detach())
            checked += 1
    assert checked == 6
