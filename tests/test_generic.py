"""The generic family (models/generic.py): transformers' own modeling code under slipstream's
packing, loss, LoRA and offload, on tiny random configs of transformers' config classes
(float32, no network). Each test goes through the production loader (`load_model` of a
`save_pretrained` folder) and compares with transformers run one sequence at a time."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import shifted_labels
from helpers.peft_grads import lora_grads
from helpers.tiny_hf import tiny_config

from slipstream.checkpoint.adapter import save_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.debug import count_syncs
from slipstream.memory.offload import apply_checkpointing
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora

LENGTHS = [7, 11, 3]  # 11 > the window of 4 the sliding-window types get
WINDOWED = {"mistral", "gemma2", "cohere2", "starcoder2", "qwen2", "gemma3_text", "olmo3",
            "mixtral", "phi3", "gpt_oss"}  # fmt: skip
# Llama 4's chunked attention layers see only their own chunk (transformers' mask alone does
# it): chunks of 4, so the 11-token sequence spans three.
CHUNKED = {"llama4_text": {"attention_chunk_size": 4}}
# The default suite: one of each kind (dense, sliding window, softcap, MoE, gated delta net,
# short conv, Mamba2); the rest are @slow.
FAST = ["llama", "mistral", "gemma2", "mixtral", "qwen3_next", "lfm2", "granite", "gemma4_text",
        "llama4_text"]  # fmt: skip
SLOW = [
    "qwen3", "olmo2", "olmo3", "smollm3", "granitemoe", "qwen2_moe", "cohere2", "glm4_moe",
    "qwen3_5_text", "qwen3_5_moe_text", "falcon_h1", "nemotron_h",
    "ernie4_5_moe", "minimax_m2", "starcoder2", "phi", "stablelm", "qwen2", "phi3",
    "qwen3_moe", "gpt_oss", "gemma3_text", "deepseek_v3", "gemma4_text_moe",
    # beyond issue 29's list, more token mixers run per sequence: Granite 4's Mamba layers,
    # MiniMax's lightning attention (attention-free models: test_attention_free_models_...)
    "granitemoehybrid", "minimax",
]  # fmt: skip
TYPES = FAST + [pytest.param(t, marks=pytest.mark.slow) for t in SLOW]
LAYERS = {"gemma4_text": 4, "gemma4_text_moe": 4}  # 2 of them reuse the first 2's K/V


def _reference(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    window = {"sliding_window": 4} if model_type in WINDOWED else {}
    cfg = tiny_config(
        model_type, LAYERS.get(model_type, 2), **window, **CHUNKED.get(model_type, {})
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


@pytest.fixture(scope="module")
def quiet():
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _pair(tmp_path, model_type):
    ref = _reference(model_type)
    ref.save_pretrained(tmp_path / "ckpt")
    ours = load_model(tmp_path / "ckpt", implementation="transformers")
    return ref, ours


def _batch(vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(LENGTHS),), generator=g)
    return ids, shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)


def _per_sequence(ref, ids):
    return torch.cat(
        [ref(input_ids=s[None], use_cache=False).logits[0] for s in ids.split(LENGTHS)]
    )


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", TYPES)
def test_packed_logits_and_lora_grads_equal_per_sequence(tmp_path, quiet, model_type):
    """Packed logits, loss and LoRA gradients equal transformers' + peft's per sequence,
    through the adapter files (so peft loads ours unchanged, under transformers' names)."""
    _assert_adapter_equals_peft(tmp_path, model_type)


@pytest.mark.parametrize("model_type", ["olmo2", "gemma2", "lfm2"])
def test_dora_equals_peft_per_sequence(tmp_path, quiet, model_type):
    """DoRA (a trained magnitude per output row) on transformers' modules: packed logits,
    loss and every factor's and magnitude's gradient equal peft's DoRA per sequence."""
    _assert_adapter_equals_peft(tmp_path, model_type, use_dora=True)


def _assert_adapter_equals_peft(tmp_path, model_type, use_dora=False):
    from peft import PeftModel

    ref, ours = _pair(tmp_path, model_type)
    ids, labels, seq = _batch()
    with torch.no_grad():
        assert _rel(ours(ids, seq), _per_sequence(ref.eval(), ids)) < 1e-4
    apply_lora(ours, rank=4, alpha=8, use_dora=use_dora)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
            if "magnitude" in name:  # DoRA: off the weight norm it starts at
                p.mul_(1 + 0.1 * torch.randn_like(p))
    save_adapter(ours, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(ref, tmp_path / "adapter", is_trainable=True)
    logits = _per_sequence(peft_model, ids)
    keep = labels != -100
    ref_loss = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    ref_loss.backward()
    positions = keep.nonzero()[:, 0]
    loss = ours.loss(ids, labels, seq, reduction="sum", label_positions=positions)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    theirs = {
        n.replace(".default", "").replace("magnitude_vector.weight", "magnitude_vector"): p.grad
        for n, p in peft_model.named_parameters()
    }
    grads = lora_grads(ours)  # stacked experts' factors (MoE types) in peft's layout
    assert grads and set(grads) <= set(theirs)
    assert not use_dora or any("magnitude" in n for n in grads)
    for name, grad in grads.items():
        assert _rel(grad, theirs[name]) < 1e-4, name


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "gemma4_text"])
def test_offload_and_recompute_give_the_same_gradients(tmp_path, quiet, model_type):
    """Each GradientCheckpointingLayer under slipstream's offload Function (forced on CPU:
    the real schedule with synchronous copies) and under recompute: the gradients of none."""
    _, ours = _pair(tmp_path, model_type)
    apply_lora(ours, rank=4, alpha=8)
    ids, labels, seq = _batch()

    def grads(mode):
        apply_checkpointing(ours, mode, force=True)
        ours.zero_grad()
        ours.loss(ids, labels, seq, reduction="sum").backward()
        return {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}

    plain = grads("none")
    for mode in ("offload", "recompute"):
        got = grads(mode)
        assert set(got) == set(plain)
        for name in plain:
            torch.testing.assert_close(got[name], plain[name], rtol=1e-5, atol=1e-6)
    assert type(ours.decoder_layers()[0]).__name__.startswith("Checkpointed")


def test_state_never_crosses_a_packed_boundary(tmp_path, quiet):
    """Without the per-sequence run of its gated delta net, Qwen3-Next's packed logits would
    carry state from one sequence into the next: the wrapper is what makes them equal."""
    from slipstream.models import generic_hooks

    ref, ours = _pair(tmp_path, "qwen3_next")
    assert ours.per_sequence == ["layers.0.linear_attn"]
    ids, _, seq = _batch()
    mixer = ours.decoder_layers()[0].linear_attn
    with torch.no_grad():
        expected = _per_sequence(ref.eval(), ids)
        assert _rel(ours(ids, seq), expected) < 1e-4
        mixer.__class__ = mixer._slipstream_per_sequence  # unwrapped: state leaks
        assert _rel(ours(ids, seq), expected) > 1e-3
    assert generic_hooks.SEQ_KWARG == "slipstream_seq"


FULL = ["olmo2", "mamba"] + [
    pytest.param(t, marks=pytest.mark.slow) for t in ("gemma2", "lfm2", "falcon_mamba", "rwkv")
]


@pytest.mark.parametrize("model_type", FULL)
def test_full_fine_tuning_equals_transformers_per_sequence(tmp_path, quiet, model_type):
    """Full fine-tuning under recompute checkpointing: packed logits, loss and every
    parameter's gradient equal transformers' one sequence at a time. Mamba's and RWKV's
    backbones drop the forward's kwargs: a pre-hook on each decoder layer hands it the
    batch's SeqInfo, so its mixers still run per sequence, in the recompute too. (Their
    linears all sit in the mixers, which all-linear LoRA leaves out: full is their path.)"""
    ref, ours = _pair(tmp_path, model_type)
    apply_checkpointing(ours, "recompute")
    ids, labels, seq = _batch()
    with torch.no_grad():
        assert _rel(ours(ids, seq), _per_sequence(ref.eval(), ids)) < 1e-5
    ref.train()  # RWKV rescales weights in eval mode
    keep = labels != -100
    logits = _per_sequence(ref, ids)
    want = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    want.backward()
    loss = ours.loss(ids, labels, seq, reduction="sum")
    loss.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, theirs[name].grad) < 1e-4, name


def test_a_stateful_layer_that_cannot_run_per_sequence_is_refused(tmp_path, quiet, capsys):
    """RecurrentGemma's recurrent block (its own position and segment arguments: not split
    per sequence here) would carry state across packed boundaries: one line naming the layer
    at load, exit 2 from the CLI."""
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoModelForCausalLM

    from slipstream import cli

    folder = tmp_path / "m"
    save_test_tokenizer(folder, "chatml", vocab_size=300)
    cfg = tiny_config("recurrent_gemma", vocab_size=300)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"layers.0.temporal_block \(RecurrentGemmaRecurrent") as e:
        load_model(folder)
    assert "\n" not in str(e.value) and "packed sequences would share its state" in str(e.value)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    raw = {"model": {"path": str(folder)}, "data": {"train": str(tmp_path / "d.jsonl")},
           "output_dir": str(tmp_path / "o"), "train": {"steps": 1}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "RecurrentGemmaRecurrentBlock" in err[-1]


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "qwen3_next"])
def test_a_training_step_adds_no_host_sync(tmp_path, quiet, model_type):
    """Forward, loss and backward of a LoRA step: no mask is built, nothing is read back
    (transformers' own find_packed_sequence_indices never runs)."""
    _, ours = _pair(tmp_path, model_type)
    apply_lora(ours, rank=4, alpha=8)
    apply_checkpointing(ours, "recompute")
    ids, labels, seq = _batch()
    positions = (labels != -100).nonzero()[:, 0]
    with count_syncs() as syncs:
        ours.loss(ids, labels, seq, reduction="sum", label_positions=positions).backward()
    assert syncs.total == 0, syncs


NATIVE = ["llama", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "gpt_oss", "mistral"]


@pytest.mark.parametrize(
    "model_type", [t if t in ("llama", "qwen3") else pytest.param(t, marks=pytest.mark.slow)
                   for t in NATIVE],
)  # fmt: skip
def test_native_and_generic_agree(tmp_path, quiet, model_type):
    """The same checkpoint through the native family and through transformers' code:
    logits, loss and the adapter files' keys agree."""
    ref = _reference(model_type)
    ref.save_pretrained(tmp_path / "ckpt")
    native = load_model(tmp_path / "ckpt")
    generic = load_model(tmp_path / "ckpt", implementation="transformers")
    assert native.config.implementation == "native"
    assert type(generic).__name__ == "GenericCausalLM"
    ids, labels, seq = _batch()
    with torch.no_grad():
        assert _rel(generic(ids, seq), native(ids, seq)) < 1e-4
        a, b = native.loss(ids, labels, seq), generic.loss(ids, labels, seq)
        assert abs(a.item() - b.item()) < 1e-4 * abs(a.item())
    keys = []
    for name, model in (("native", native), ("generic", generic)):
        attention = ["qkv_proj", "o_proj"] if model_type == "phi3" else ["q_proj", "o_proj"]
        apply_lora(model, rank=4, alpha=8, targets=attention)  # expert LoRA: native only
        save_adapter(model, tmp_path / name)
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        from safetensors import safe_open

        with safe_open(str(tmp_path / name / "adapter_model.safetensors"), "pt") as f:
            keys.append((sorted(f.keys()), cfg["target_modules"]))
    assert keys[0] == keys[1]


def test_export_merged_loads_in_transformers(tmp_path, quiet):
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.export import export_merged

    _, ours = _pair(tmp_path, "mixtral")
    apply_lora(ours, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, _, seq = _batch()
    with torch.no_grad():
        expected = ours(ids, seq)
    export_merged(ours, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    with torch.no_grad():
        assert _rel(_per_sequence(merged, ids), expected) < 1e-4


def test_bad_inputs_are_one_line(tmp_path, quiet):
    from slipstream.models import choose_family

    with pytest.raises(ValueError, match="model_type 't5' is not supported") as e:
        choose_family("t5", "x/config.json")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="implementation=native but model_type 'mixtral'"):
        choose_family("mixtral", "x", "native")
    remote = {"model_type": "my_model", "auto_map": {"AutoModelForCausalLM": "m.MyLM"}}
    with pytest.raises(ValueError, match="trust_remote_code: true"):
        choose_family("my_model", "x", "auto", remote)
    assert choose_family("my_model", "x", "auto", remote, True)[0] == "generic"
    assert choose_family("llama", "x")[0] == "llama"
    assert choose_family("llama", "x", "transformers")[0] == "generic"
    cfg = tiny_config("llama").to_dict()
    cfg.update(model_type="mixtral", hidden_act="no_such_activation")
    from slipstream.models import generic

    meta = torch.device("meta")
    with pytest.raises(ValueError, match="transformers cannot build 'mixtral'") as e, meta:
        generic.build(generic.config_from_hf(cfg))
    assert "\n" not in str(e.value)


def test_cli_refuses_native_on_a_type_without_one(tmp_path, quiet, capsys):
    from slipstream import cli

    folder = tmp_path / "m"
    _reference("olmo2").save_pretrained(folder)
    run = tmp_path / "run.yaml"
    raw = {
        "model": {"path": str(folder), "implementation": "native"},
        "data": {"train": str(tmp_path / "d.jsonl")},
        "output_dir": str(tmp_path / "o"),
    }
    run.write_text(json.dumps(raw))
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    assert cli.main(["train", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "implementation=native but model_type 'olmo2'" in err[-1]


def test_standard_experts_run_slipstreams_one_pass_routing(tmp_path, quiet, monkeypatch):
    """Mixtral's stacked experts dispatch to our ExpertsInterface function (ops.moe's plan and
    grouped GEMMs) with transformers' router; gpt-oss's biased, transposed ones to its own."""
    from slipstream.models import generic_hooks

    plans = []
    real_plan = generic_hooks.plan
    monkeypatch.setattr(generic_hooks, "plan", lambda *a: plans.append(1) or real_plan(*a))
    ref, ours = _pair(tmp_path, "mixtral")
    assert ours.hf.config._experts_implementation == "slipstream"
    ids, _, seq = _batch()
    with torch.no_grad():
        assert _rel(ours(ids, seq), _per_sequence(ref.eval(), ids)) < 1e-4
    assert len(plans) == 2  # one per MoE layer


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gemma4_text"])
def test_greedy_generation_equals_transformers_generate(tmp_path, quiet, model_type):
    """The KV-cache engine runs transformers' softmax-attention layers through the same
    attention function (the cache hook rides on the SeqInfo)."""
    from slipstream.generation import engine

    ref, ours = _pair(tmp_path, model_type)
    prompts = [[5, 9, 11, 4], [7, 3, 8, 20, 21, 22]]
    greedy = engine.Sampling(0.0, 1.0, 0)
    rows = engine.run(ours, prompts, max_new_tokens=6, sampling=greedy, stop_ids=[2])
    ref.eval()
    for row, p in zip(rows, prompts, strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :]
        assert list(row.token_ids) == want.tolist()


@pytest.mark.slow
def test_a_dpo_run_on_a_generic_model(tmp_path, quiet):
    """Two DPO steps (reference = the base, adapters disabled) on OLMo 2 through the trainer:
    both steps' losses are logged and finite."""
    from helpers.runs import run_config
    from helpers.tokenizers import save_test_tokenizer
    from test_preference_train import pair_rows
    from transformers import AutoModelForCausalLM

    from slipstream.config import config_from_dict
    from slipstream.train.loop import train

    model_dir = tmp_path / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("olmo2", vocab_size=300)).save_pretrained(
        model_dir
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(8)))
    raw = run_config((model_dir, pairs), tmp_path / "dpo", objective="dpo", steps=2, lr=1e-2)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4}
    raw["train"]["tokens_per_batch"] = 256
    raw["data"].pop("eval_fraction", None)
    summary = train(config_from_dict(raw))
    rows = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    assert summary is not None


def test_preview_says_which_path_and_why(tmp_path, quiet, capsys):
    """`slipstream preview` names the path a model takes and why, before any weights load:
    OLMo 2 on transformers' code (no native family), a Llama on its native family or, forced,
    on transformers' code; native on OLMo 2 is one line, exit 2."""
    from helpers.runs import chat_rows, make_tiny_run, run_config
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoModelForCausalLM

    from slipstream import cli

    llama, data = make_tiny_run(tmp_path)
    olmo2 = tmp_path / "olmo2"
    save_test_tokenizer(olmo2, "chatml", vocab_size=300)
    AutoModelForCausalLM.from_config(tiny_config("olmo2", vocab_size=300)).save_pretrained(olmo2)
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(16)))
    said = {}
    for name, folder, implementation in [("olmo2", olmo2, "auto"), ("llama", llama, "auto"),
                                         ("forced", llama, "transformers")]:  # fmt: skip
        raw = run_config((folder, data), tmp_path / f"out_{name}")
        raw["model"]["implementation"] = implementation
        (tmp_path / f"{name}.yaml").write_text(json.dumps(raw))
        assert cli.main(["preview", str(tmp_path / f"{name}.yaml")]) == 0
        said[name] = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model "))
    assert said == {
        "olmo2": "model olmo2: transformers' modeling code: no native family for 'olmo2'",
        "llama": "model llama: native family slipstream/models/llama.py",
        "forced": "model llama: transformers' modeling code, as model.implementation="
        "transformers asks",
    }
    args = ["preview", str(tmp_path / "olmo2.yaml"), "model.implementation=native"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "implementation=native but model_type 'olmo2'" in err[0]


def test_a_full_fine_tuning_run_saves_what_transformers_loads(tmp_path, quiet):
    """A 2-step full fine-tuning run of OLMo 2 (no native family) through the trainer: the
    saved checkpoint loads in transformers with our model's logits, and the weights moved."""
    from helpers.runs import chat_rows, run_config
    from helpers.tokenizers import save_test_tokenizer
    from transformers import AutoModelForCausalLM

    from slipstream.config import config_from_dict
    from slipstream.train.loop import train

    base = tmp_path / "olmo2"
    save_test_tokenizer(base, "chatml", vocab_size=300)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("olmo2", vocab_size=300)).save_pretrained(base)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(16)))
    raw = run_config((base, data), tmp_path / "out", steps=2)
    assert raw["train"]["finetune"] == "full"
    assert train(config_from_dict(raw))["status"] == "completed"
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7, 8])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ours = load_model(tmp_path / "out").eval()
    before = AutoModelForCausalLM.from_pretrained(base).float().eval()
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        assert _rel(ours(ids, SeqInfo.from_lengths([len(ids)])), want) < 1e-5
        assert _rel(before(input_ids=ids[None]).logits[0], want) > 1e-3
    assert type(ours).__name__ == "GenericCausalLM"


def test_cli_refuses_remote_code_without_trust_remote_code(tmp_path, quiet, capsys):
    """A checkpoint that names its own modeling code (auto_map, a type transformers does not
    know): `slipstream train` and `preview` say so in one line, exit 2, before loading it."""
    from helpers.runs import chat_rows, run_config
    from helpers.tokenizers import save_test_tokenizer

    from slipstream import cli

    folder = tmp_path / "remote"
    save_test_tokenizer(folder, "chatml", vocab_size=300)
    config = {"model_type": "my_remote_lm", "auto_map": {"AutoModelForCausalLM": "m.MyLM"},
              "architectures": ["MyLM"], "hidden_size": 32}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(4)))
    (tmp_path / "r.yaml").write_text(json.dumps(run_config((folder, data), tmp_path / "o")))
    for command in ("train", "preview"):
        assert cli.main([command, str(tmp_path / "r.yaml")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert "model_type 'my_remote_lm' needs the checkpoint's own modeling code" in err[0]
        assert "model.trust_remote_code: true" in err[0]
    assert not (tmp_path / "o").exists()
