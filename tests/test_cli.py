"""The `slipstream` command: train (LoRA) end to end, export, and exit status 2 with one line
for a user's mistake."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import run_config

from slipstream import cli


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def lora_config(tiny_run, out):  # noqa: F811
    raw = run_config(tiny_run, out, lr=2e-2, steps=10, grad_accum=2, eval_every=5)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 8, "alpha": 16, "targets": "all-linear"}
    return raw


def test_train_lora_then_export(tiny_run, tmp_path, capsys):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import slipstream

    out, merged = tmp_path / "run", tmp_path / "merged"
    config = write_yaml(tmp_path / "run.yaml", lora_config(tiny_run, tmp_path / "ignored"))
    assert cli.main(["train", str(config), f"output_dir={out}", "lora.rank=4"]) == 0
    assert "completed at step 10" in capsys.readouterr().out

    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0
    assert summary["trainable_params"] < summary["total_params"] / 5  # LoRA only
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4  # the override reached the adapter
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]

    # The adapter loads in peft on the transformers model and gives our model's logits.
    model_dir = tiny_run[0]
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    ours = slipstream.load_model(model_dir)
    slipstream.load_adapter(ours, out)
    ours_logits = ours(ids[0], slipstream.SeqInfo.from_lengths([ids.shape[1]]))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_logits = PeftModel.from_pretrained(hf, out).eval()(ids).logits[0]
    torch.testing.assert_close(ours_logits, peft_logits, atol=1e-4, rtol=1e-4)
    base_logits = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits[0]
    assert (base_logits - peft_logits).abs().max() > 1e-2  # the adapter changed something

    # Merged export loads in plain transformers with the same logits.
    assert cli.main(["export", str(out), "--base", str(model_dir), "--out", str(merged)]) == 0
    merged_logits = AutoModelForCausalLM.from_pretrained(merged)(ids).logits[0]
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=1e-4)
    assert (merged / "tokenizer.json").is_file()


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("slipstream: error: ")
    assert "Traceback" not in err
    return err


def test_unknown_key_exits_2_with_suggestion(tiny_run, tmp_path, capsys):  # noqa: F811
    config = write_yaml(tmp_path / "run.yaml", lora_config(tiny_run, tmp_path / "out"))
    assert cli.main(["train", str(config), "train.learning_rate=1e-4"]) == 2
    err = error_line(capsys)
    assert "train.learning_rate" in err and "did you mean 'train.lr'" in err
    assert not (tmp_path / "out").exists()  # rejected before any work


@pytest.mark.parametrize(
    "override, key",
    [("train.lr=-1", "train.lr"), ("lora.rank=0", "lora.rank"),
     ("train.tokens_per_batch=0", "train.tokens_per_batch")],
)  # fmt: skip
def test_bad_value_exits_2_naming_key(tiny_run, tmp_path, capsys, override, key):  # noqa: F811
    config = write_yaml(tmp_path / "run.yaml", lora_config(tiny_run, tmp_path / "out"))
    assert cli.main(["train", str(config), override]) == 2
    assert f"config: {key}:" in error_line(capsys)


def test_unwritable_output_dir_exits_2(tiny_run, tmp_path, capsys):  # noqa: F811
    (tmp_path / "a_file").write_text("not a folder")
    config = write_yaml(tmp_path / "run.yaml", lora_config(tiny_run, tmp_path / "a_file" / "run"))
    assert cli.main(["train", str(config)]) == 2
    assert "output_dir" in error_line(capsys)


def test_missing_files_exit_2(tiny_run, tmp_path, capsys):  # noqa: F811
    assert cli.main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in error_line(capsys)
    raw = lora_config(tiny_run, tmp_path / "out")
    raw["data"]["train"] = str(tmp_path / "missing.jsonl")
    config = write_yaml(tmp_path / "run.yaml", raw)
    assert cli.main(["train", str(config)]) == 2
    assert "missing.jsonl" in error_line(capsys)
    assert cli.main(["export", str(tmp_path), "--base", "x", "--out", str(tmp_path / "m")]) == 2
    assert "adapter_config.json" in error_line(capsys)


def test_bad_data_row_exits_2_naming_the_line(tiny_run, tmp_path, capsys):  # noqa: F811
    data = tmp_path / "broken.jsonl"
    data.write_text(tiny_run[1].read_text() + "{not json\n")
    raw = lora_config(tiny_run, tmp_path / "out")
    raw["data"]["train"] = str(data)
    assert cli.main(["train", str(write_yaml(tmp_path / "run.yaml", raw))]) == 2
    err = error_line(capsys)
    assert "broken.jsonl" in err and "49" in err  # the bad line's number


def test_module_entry_point_exit_status(tmp_path):
    """`python -m slipstream`: exit 2, one stderr line, no traceback, in a real process."""
    config = write_yaml(tmp_path / "run.yaml", {"model": {"path": "m"}, "lora": {"rnak": 4}})
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "train", str(config)],
        capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "slipstream: error: config: unknown key 'lora.rnak' (did you mean 'lora.rank'?)"
    )
    with pytest.raises(SystemExit) as e:  # argparse: a command is required
        cli.main([])
    assert e.value.code == 2


def test_demo_and_bench_dispatch(monkeypatch, capsys):
    import slipstream.demo

    seen = {}
    monkeypatch.setattr(slipstream.demo, "run_demo", lambda args: seen.setdefault("args", args))
    assert cli.main(["demo", "--output-dir", "somewhere"]) == 0
    assert seen["args"].output_dir == "somewhere"
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    assert "no_such_benchmark" in error_line(capsys)


OOM = (
    "CUDA out of memory. Tried to allocate 3.88 GiB. GPU 0 has a total capacity of 139.8 GiB "
    "of which 1.2 GiB is free. Including non-PyTorch memory, this process has 138.5 GiB "
    "memory in use. Of the allocated memory 131.0 GiB is allocated by PyTorch."
)


@pytest.mark.parametrize(
    "overrides,tips,not_tips",
    [
        (["train.finetune=full"], ["adamw_8bit", "train.finetune=lora", "offload"], ["nf4"]),
        (["train.activation_checkpointing=offload", "model.quantization=nf4"], [],
         ["adamw_8bit", "nf4", "offload"]),
        (["train.activation_checkpointing=recompute"], ["nf4", "offload"], ["adamw_8bit"]),
    ],
)  # fmt: skip
def test_out_of_gpu_memory_is_one_line_with_this_runs_knobs(
    tiny_run, tmp_path, capsys, monkeypatch, overrides, tips, not_tips
):
    import slipstream.train

    def out_of_memory(cfg):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(slipstream.train, "train", out_of_memory)
    config = write_yaml(tmp_path / "run.yaml", lora_config(tiny_run, tmp_path / "out"))
    assert cli.main(["train", str(config), "train.tokens_per_batch=4096", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("slipstream: error: out of GPU memory (CUDA out of memory. Tried to")
    assert "is free.)" in err and "non-PyTorch" not in err  # torch's figures, not its essay
    assert "train.tokens_per_batch (now 4096)" in err
    for tip in tips:
        assert tip in err, tip
    for tip in not_tips:
        assert tip not in err, tip


def test_generate_replies_as_transformers_and_peft_do(tiny_run, tmp_path, capsys):
    """`slipstream generate ADAPTER_DIR prompt` finds the base model and tokenizer, applies
    the chat template and decodes the greedy reply that transformers + peft generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import slipstream

    model_dir, adapter = tiny_run[0], tmp_path / "adapter"
    model = slipstream.load_model(model_dir)
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    slipstream.save_adapter(model, adapter, base_model_name_or_path=str(model_dir))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(adapter)

    prompt = "What color is the sky?"
    assert cli.main(["generate", str(adapter), prompt, "--max-new-tokens", "12"]) == 0
    reply = capsys.readouterr().out.strip()

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, adapter).eval()
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    out = peft_model.generate(
        input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=stops, pad_token_id=0
    )[0, ids.shape[1] :]
    assert reply == tok.decode(out, skip_special_tokens=True).strip()
    assert len(reply) > 0

    # The base model alone (a model folder, not an adapter) replies differently.
    assert cli.main(["generate", str(model_dir), prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() != reply

    (adapter / "adapter_config.json").write_text(
        (adapter / "adapter_config.json").read_text().replace(str(model_dir), "")
    )
    assert cli.main(["generate", str(adapter), prompt]) == 2
    assert "names no base model; pass --base MODEL" in capsys.readouterr().err


def test_unsupported_model_type_exits_2_before_tokenizing(tiny_run, tmp_path, monkeypatch, capsys):
    """preview, train and generate on a model type slipstream cannot build: one line listing
    the supported types, said from config.json before a tokenizer (or the data) loads; the
    Python API's build_data says it before tokenizing too."""
    import slipstream.checkpoint.hf as hf
    import slipstream.checkpoint.tokenizer as tokenizer_module
    from slipstream.config import load_config
    from slipstream.models import FAMILIES
    from slipstream.train.setup import build_data

    def no_load(*a, **k):
        raise AssertionError("a tokenizer or model loaded before the model type was checked")

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", no_load)
    monkeypatch.setattr(hf, "load_model", no_load)
    import transformers

    model = tmp_path / "t5"  # no causal LM: neither a native family nor transformers' code
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "t5", "num_layers": 2}))
    raw = lora_config(tiny_run, tmp_path / "out")
    raw["model"]["path"] = str(model)
    config = write_yaml(tmp_path / "run.yaml", raw)
    said = (
        f"model_type 't5' is not supported: it has no native family "
        f"({', '.join(sorted(FAMILIES))}) and transformers {transformers.__version__} builds "
        "no causal LM of that type (AutoModelForCausalLM)."
    )
    for argv in (["preview", str(config)], ["train", str(config)], ["generate", str(model), "Hi"]):
        assert cli.main(argv) == 2, argv
        assert error_line(capsys).endswith(f"{model / 'config.json'}: {said}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="model_type 't5' is not supported"):
        build_data(load_config(str(config)), tokenizer=None)
