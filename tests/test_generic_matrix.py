"""The generic family end to end, per model type (issue 29's list): a 2-step `slipstream
train` from the CLI on a tiny random checkpoint; the adapter loads in peft on transformers'
model with our logits; `slipstream export` writes a merged checkpoint transformers loads with
those logits; greedy generation (our engine or transformers' generate, as the model needs)
equals transformers + peft's `generate`. OLMo 2 in the default suite, the rest @slow."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers.runs import chat_rows
from helpers.tiny_hf import random_lora, tiny_config
from helpers.tokenizers import save_test_tokenizer
from test_generic import WINDOWED, quiet  # noqa: F401 (quiet: a fixture)

from slipstream import SeqInfo, cli, load_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.generation import engine
from slipstream.models import FAMILIES

pytestmark = pytest.mark.usefixtures("quiet")
SLOW = [
    "mixtral", "qwen2_moe", "gemma2", "smollm3", "olmo3", "granite", "granitemoe", "cohere2",
    "deepseek_v3", "glm4_moe", "llama4_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
    "gemma4_text", "falcon_h1", "nemotron_h", "lfm2", "ernie4_5_moe", "minimax_m2",
    "starcoder2", "phi", "stablelm",
    # the native types, forced through transformers' modeling code
    "llama", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "gpt_oss", "mistral",
]  # fmt: skip
TYPES = ["olmo2"] + [pytest.param(t, marks=pytest.mark.slow) for t in SLOW]
LAYERS = {"nemotron_h": 3, "gemma4_text": 4}  # Mamba2, MoE and an attention layer; K/V sharing
VOCAB = 300
IDS = [5, 17, 42, 99, 3, 250, 7, 8]


def _checkpoint(folder, model_type):
    from transformers import AutoModelForCausalLM

    save_test_tokenizer(folder, "chatml", vocab_size=VOCAB)
    window = {"sliding_window": 4} if model_type in WINDOWED else {}
    vocab = {"vocab_size": VOCAB}
    if model_type == "gemma4_text":  # its per-layer input embedding has its own vocabulary
        vocab["vocab_size_per_layer_input"] = VOCAB
    cfg = tiny_config(model_type, LAYERS.get(model_type, 2), **vocab, **window)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def _train(tmp_path, model_dir, model_type, capsys):
    out = tmp_path / "run"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(16)))
    forced = {"implementation": "transformers"} if model_type in FAMILIES else {}
    raw = {
        "model": {"path": str(model_dir), **forced},
        "data": {"train": str(data)},
        "lora": {"method": "lora", "rank": 4},  # all-linear
        "train": {"lr": 1e-2, "steps": 2, "tokens_per_batch": 128, "device": "cpu",
                  "log_every": 1, "activation_checkpointing": "none"},
        "output_dir": str(out),
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    captured = capsys.readouterr()
    log = captured.out + captured.err
    assert f"model {model_type}: transformers' modeling code" in log
    assert "completed at step 2" in log
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_train_export_and_generate_match_transformers(tmp_path, model_type, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    _checkpoint(model_dir, model_type)
    out = _train(tmp_path, model_dir, model_type, capsys)

    ours = load_model(model_dir, implementation="transformers")
    load_adapter(ours, out)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(ref, out).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        mine = ours(ids, SeqInfo.from_lengths([len(IDS)]))
        want = theirs(ids[None]).logits[0]
        base = AutoModelForCausalLM.from_pretrained(model_dir)(ids[None]).logits[0]
    torch.testing.assert_close(mine, want, atol=1e-4, rtol=1e-4)
    assert (base - want).abs().max() > 1e-3  # two steps moved the adapter

    assert cli.main(["export", str(out), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids[None]).logits[0], want, atol=1e-4, rtol=1e-4)

    prompts = [IDS[:4], IDS[2:8]]
    rows = engine.run(ours, prompts, max_new_tokens=8, sampling=engine.Sampling(), stop_ids=[2])
    for row, p in zip(rows, prompts, strict=True):
        got = theirs.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              eos_token_id=2, pad_token_id=0)  # fmt: skip
        assert row.token_ids == got[0, len(p) :].tolist(), (row.token_ids, got)


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_next", "llama4_text"]
    + [pytest.param(t, marks=pytest.mark.slow) for t in ("deepseek_v3", "falcon_h1", "glm4_moe")],
)
def test_all_linear_adapters_round_trip_through_peft(tmp_path, model_type):
    """`lora.targets: all-linear` (the config's default) on transformers' modeling code loads
    in peft with our logits and trains: MoE MLP names on the stacked experts only (expert
    LoRA), no Llama 4 router (an nn.Linear returning a tuple), no Mamba2 mixer linear (read by
    weight in transformers' fused training path)."""
    from peft import PeftModel
    from test_generic import _pair

    ref, ours = _pair(tmp_path, model_type)
    random_lora(ours, tmp_path / "adapter", targets="all-linear")
    theirs = PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    ids = torch.tensor(IDS) % 96
    with torch.no_grad():
        mine = ours.eval()(ids, SeqInfo.from_lengths([len(IDS)]))
        torch.testing.assert_close(mine, theirs(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    ours.train()
    ids_T, seq = ids, SeqInfo.from_lengths([len(IDS)])
    ours.loss(ids_T, torch.roll(ids_T, -1), seq).backward()  # the training path runs too


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.slow) for t in SLOW])
def test_a_dpo_step_equals_transformers_and_peft(tmp_path, model_type):
    """One DPO micro-batch (reference = the base, adapters disabled) on each type: the loss
    equals DPO's formula over transformers + peft's per-sequence log-probs, and the step's
    LoRA gradients are finite and not all zero."""
    import torch.nn.functional as F
    from peft import PeftModel
    from test_generic import _pair

    from slipstream.objectives.pairs import PairExample
    from slipstream.objectives.preference import pair_objective
    from slipstream.objectives.reference import ReferencePolicy

    ref, ours = _pair(tmp_path, model_type)
    random_lora(ours, tmp_path / "adapter")
    g = torch.Generator().manual_seed(5)
    pairs = []
    for prompt_len, a, b in ((4, 5, 3), (6, 2, 7)):
        prompt = torch.randint(3, 96, (prompt_len,), generator=g).tolist()
        chosen, rejected = (torch.randint(3, 96, (n,), generator=g).tolist() for n in (a, b))
        pairs.append(PairExample(prompt + chosen, prompt + rejected, prompt_len))
    objective = pair_objective("dpo", beta=0.1)
    objective.reference = ReferencePolicy(ours, "base")
    loss, _ = objective.micro_batch_loss(ours, objective.collate(pairs))
    loss.backward()

    def logp(model, ids, start):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return lp[start - 1 :].sum()

    policy = PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    want = 0.0
    for p in pairs:
        z = logp(policy, p.chosen, p.prompt_len) - logp(policy, p.rejected, p.prompt_len)
        with policy.disable_adapter():
            z = z - logp(policy, p.chosen, p.prompt_len) + logp(policy, p.rejected, p.prompt_len)
        want = want - F.logsigmoid(0.1 * z)
    assert loss.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
    grads = [p.grad for n, p in ours.named_parameters() if "lora_" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
