"""MoE fine-tuning end to end with the one LoRA API: merged export with expert LoRA equals
transformers; the trainer's router aux loss equals transformers' `loss + coef * aux` (grads
too) and syncs nothing; `slipstream train` + export on tiny Qwen3-MoE and GPT-OSS checkpoints
(LoRA all-linear: attention and experts) gives adapters that peft loads with our logits."""

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers.moe_models import make_hf_moe_model
from helpers.runs import chat_rows
from helpers.tokenizers import save_test_tokenizer

import slipstream
from slipstream import cli
from slipstream.config import config_from_dict
from slipstream.debug import count_syncs
from slipstream.models.moe_block import router_aux_loss_coef, set_router_aux_loss_coef
from slipstream.objectives.sft import SFT
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora
from slipstream.peft.lora_experts import expert_lora_modules
from slipstream.train.loop import accumulate_gradients
from slipstream.train.setup import build_model

FAMILIES = ["qwen3_moe", "gpt_oss"]
VOCAB = 300


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def moe_run(request, tmp_path_factory):
    """A tiny MoE checkpoint with tokenizer files (GPT-OSS: its own aux loss on, coef 0.02,
    so `train.router_aux_loss_coef: null` keeps it) and a jsonl chat dataset."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model_dir = root / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=VOCAB)
    own_aux = dict(output_router_logits=True, router_aux_loss_coef=0.02)
    make_hf_moe_model(
        family, seed=1, vocab_size=VOCAB, initializer_range=0.2,
        **(own_aux if family == "gpt_oss" else {}),
    ).save_pretrained(model_dir)  # fmt: skip
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(48)))
    return family, model_dir, data


def _config(moe_run, out, **train):
    family, model_dir, data = moe_run
    return {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data), "eval_fraction": 0.125},
        "lora": {"rank": 4, "alpha": 8, "targets": "all-linear"},
        "train": {
            "lr": 2e-2, "steps": 8, "tokens_per_batch": 128, "grad_accum": 2, "log_every": 1,
            "device": "cpu", "activation_checkpointing": "recompute", **train,
        },
        "output_dir": str(out),
    }  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_export_merged_with_expert_lora_matches_transformers(family, tmp_path):
    """LoRA on attention and experts (B random) -> export_merged -> transformers: same logits."""
    base, merged = tmp_path / "base", tmp_path / "merged"
    make_hf_moe_model(family, seed=2).save_pretrained(base)
    model = apply_lora(slipstream.load_model(base), rank=4, alpha=8, targets="all-linear")
    assert expert_lora_modules(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        ids = torch.randint(0, 97, (11,), generator=gen)
        ours = model(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(model, merged)
    assert not expert_lora_modules(model) and model.lora_config is None
    with torch.no_grad():
        ref = _hf(merged)(ids[None]).logits[0]
        before = _hf(base)(ids[None]).logits[0]
    torch.testing.assert_close(ref, ours, atol=1e-4, rtol=1e-4)
    assert (before - ours).abs().max() > 1e-2  # the expert deltas are in the export


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_in_the_objective_matches_transformers(family, tmp_path):
    """One micro-batch: the SFT objective's loss and gradients equal those of transformers' loss
    with output_router_logits (`loss + coef * aux`); the reported aux equals transformers'."""
    make_hf_moe_model(
        family, seed=4, output_router_logits=True, router_aux_loss_coef=0.3
    ).save_pretrained(tmp_path)
    hf = _hf(tmp_path).train()  # eval() would not matter: no dropout in these configs
    ids = _ids(13, 5) % 97
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    ref = hf(input_ids=ids[None], labels=ids[None])
    ref.loss.backward()

    ours = slipstream.load_model(tmp_path).requires_grad_(True)
    assert router_aux_loss_coef(ours) == 0.3  # the checkpoint's own
    batch = SimpleNamespace(
        input_ids=ids, labels=labels, seq=SeqInfo.from_lengths([13]), num_labels=12
    )
    loss_sum, metrics = accumulate_gradients(ours, [batch], SFT())
    torch.testing.assert_close(metrics["aux_loss"] / 12, ref.aux_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_sum / 12, ref.loss, atol=1e-5, rtol=1e-5)  # loss + coef*aux
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref_grad = hf_grads[name].grad
        torch.testing.assert_close(p.grad, ref_grad, atol=2e-5, rtol=1e-4, msg=name)
    router = "mlp.gate.weight" if family == "qwen3_moe" else "mlp.router.weight"
    # the aux term does reach the router: without it the router's gradient differs
    ours.zero_grad()
    set_router_aux_loss_coef(ours, 0.0)
    accumulate_gradients(ours, [batch], SFT())
    assert not torch.allclose(ours.get_parameter(f"model.layers.0.{router}").grad,
                              hf_grads[f"model.layers.0.{router}"].grad, atol=1e-6)  # fmt: skip


def test_aux_loss_micro_batch_has_no_host_sync(moe_run, tmp_path):
    """LoRA all-linear (experts too) + aux loss: forward and backward of a window, no sync."""
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data import collate
    from slipstream.train.setup import build_data

    family, model_dir, _ = moe_run
    cfg = config_from_dict(_config(moe_run, tmp_path, router_aux_loss_coef=0.01))
    model = build_model(cfg, torch.device("cpu"))
    assert router_aux_loss_coef(model) == 0.01 and expert_lora_modules(model)
    data = build_data(cfg, load_tokenizer(str(model_dir)))
    window = [collate([data.train[i] for i in b]) for b in data.train_batches[:2]]
    accumulate_gradients(model, window, SFT())  # warm-up (lazy inits)
    with count_syncs() as syncs:
        _, metrics = accumulate_gradients(model, window, SFT())
    assert syncs.total == 0, str(syncs)
    assert metrics["aux_loss"] > 0
    grads = [p.grad for n, p in model.named_parameters() if ".experts.lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_router_aux_loss_coef_config(moe_run, tmp_path):
    family, model_dir, _ = moe_run
    cfg = _config(moe_run, tmp_path)
    own = 0.02 if family == "gpt_oss" else 0.0  # see moe_run
    assert router_aux_loss_coef(build_model(config_from_dict(cfg), torch.device("cpu"))) == own
    cfg["train"]["router_aux_loss_coef"] = 0
    assert router_aux_loss_coef(build_model(config_from_dict(cfg), torch.device("cpu"))) == 0
    cfg["lora"]["dropout"] = 0.1  # experts have no dropout (PEFT has none on parameters)
    with pytest.raises(ValueError, match="dropout=0.1 is not supported on MoE experts"):
        build_model(config_from_dict(cfg), torch.device("cpu"))


def test_train_and_export_end_to_end(moe_run, tmp_path, capsys):
    """`slipstream train` (LoRA all-linear, aux loss on) then `slipstream export`: the loss
    drops, aux_loss is logged, the adapter loads in peft with our logits, and the merged
    checkpoint loads in transformers with the same logits."""
    from peft import PeftModel

    family, model_dir, _ = moe_run
    out, merged = tmp_path / "run", tmp_path / "merged"
    raw = _config(moe_run, out)
    if family == "qwen3_moe":  # GPT-OSS keeps its checkpoint's own coefficient (0.02)
        raw["train"]["router_aux_loss_coef"] = 0.01
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(config)]) == 0
    assert "completed at step 8" in capsys.readouterr().out

    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(0.5 < r["aux_loss"] < 8 for r in steps)  # E * sum(f * p): 1 when balanced
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert {"q_proj", "o_proj"} <= set(adapter["target_modules"])

    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 64]])
    with torch.no_grad():
        ours = slipstream.load_adapter(slipstream.load_model(model_dir), out)
        ours_logits = ours(ids[0], SeqInfo.from_lengths([ids.shape[1]]))
        peft_logits = PeftModel.from_pretrained(_hf(model_dir), out).eval()(ids).logits[0]
        base_logits = _hf(model_dir)(ids).logits[0]
    torch.testing.assert_close(ours_logits, peft_logits, atol=1e-4, rtol=1e-4)
    assert (base_logits - peft_logits).abs().max() > 1e-2  # the adapter changed something

    assert cli.main(["export", str(out), "--base", str(model_dir), "--out", str(merged)]) == 0
    with torch.no_grad():
        merged_logits = _hf(merged)(ids).logits[0]
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=1e-4)
