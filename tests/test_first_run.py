"""What a new user meets first: fast --help and early errors (no torch import), paths that do
not exist said to be missing (not bad hub ids), built-in model names, the adapter's recorded
base, exports that carry generation_config.json and leave nothing when they fail, clear data
errors, `slipstream config` and `slipstream preview`."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.runs import chat_rows, run_config

import slipstream
from slipstream import cli
from slipstream.config import closest_key, load_config, valid_keys
from slipstream.sources import (
    BUILTIN_MODELS,
    SMOLLM2_FILE,
    adapter_base,
    is_hub_id,
    resolve_model,
    safetensors_metadata,
)

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("slipstream: error: "), err
    return err[-1]


def run_cli_without_torch(tmp_path, argv: list[str]) -> tuple[int, str, bool]:
    """Run cli.main(argv) in a fresh process: (exit status, stderr, was torch imported?)."""
    code = (
        "import sys\nfrom slipstream import cli\n"
        f"try:\n    rc = cli.main({argv!r})\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')\nsys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
        timeout=120,
    )  # fmt: skip
    return proc.returncode, proc.stderr, "NO_TORCH" not in proc.stdout


def test_help_and_early_errors_answer_without_torch(tiny_run, tmp_path):
    """--help, config errors and path errors come before torch is imported (it alone takes
    seconds); so does `slipstream config`."""
    good = run_config(tiny_run, tmp_path / "out")
    cases = {
        "help": (["--help"], 0, ""),
        "train help": (["train", "--help"], 0, ""),
        "config": (["config", "train"], 0, ""),
        "unknown key": (["train", "RUN", "train.foo=1"], 2, "unknown key 'train.foo'"),
        "model path": (["train", "RUN", "model.path=missing/dir/x"], 2, "does not exist"),
        "data file": (["train", "RUN", "data.train=nope.jsonl"], 2, "nope.jsonl' does not exist"),
        "eval file": (["train", "RUN", "data.eval=e.jsonl", "data.eval_fraction=0"], 2, "e.jsonl"),
        "adapter": (["train", "RUN", "model.adapter=no/run"], 2, "model.adapter: 'no/run' does"),
        "generate": (["generate", str(tmp_path / "nope"), "hi"], 2, "does not exist"),
        "export": (["export", str(tmp_path), "--out", "m"], 2, "adapter_config.json"),
    }  # fmt: skip
    config = write_yaml(tmp_path / "run.yaml", good)
    for name, (argv, status, said) in cases.items():
        argv = [str(config) if a == "RUN" else a for a in argv]
        rc, err, torch_loaded = run_cli_without_torch(tmp_path, argv)
        assert rc == status, (name, err)
        assert said in err, (name, err)
        assert not torch_loaded, name
    assert not (tmp_path / "out").exists()


def test_help_is_fast():
    """Generous bound (a loaded 2-core machine): measured 0.3 s alone, 12 s before (torch)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "--help"], capture_output=True, text=True,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "preview" in proc.stdout
    assert time.perf_counter() - start < 8.0


def test_missing_path_is_not_called_a_bad_repo_id(tmp_path, monkeypatch):
    for text in ("/no/such/model", "./rel/model", "a/b/c", "~/x", "model.gguf", "x/y.gguf"):
        with pytest.raises(ValueError, match="does not exist") as e:
            resolve_model(text)
        assert "Repo id" not in str(e.value)
    from slipstream.checkpoint.tokenizer import load_tokenizer

    for call in (load_tokenizer, slipstream.load_model):
        with pytest.raises(ValueError, match="'/no/such/model' does not exist"):
            call("/no/such/model")
    # The hub's form, with no such local path: a hub id; an existing local path: the path.
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs") and not is_hub_id("../x")
    assert resolve_model("org/name") == "org/name"
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_model("org/name")).resolve() == tmp_path / "org" / "name"


def test_builtin_model_name_resolves_offline():
    path = Path(resolve_model("smollm2-demo"))
    assert path.name == SMOLLM2_FILE and path.is_file()
    from slipstream.checkpoint.gguf import gguf_hub_id

    assert gguf_hub_id(path) == SMOLLM2_HUB == BUILTIN_MODELS["smollm2-demo"].hub_id


def test_gguf_hub_id_from_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    from slipstream.checkpoint.gguf import gguf_hub_id

    for key, value, want in [
        ("general.source.url", "https://huggingface.co/Org/Model-1B", "Org/Model-1B"),
        ("general.source.huggingface.repository", "Org/Other", "Org/Other"),
        ("general.source.url", "https://example.com/x", None),
    ]:
        w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
        w.add_string(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert gguf_hub_id(tmp_path / "m.gguf") == want


def test_adapter_from_gguf_records_hub_id_and_keeps_local_source(tmp_path):
    """peft loads the base by base_model_name_or_path (the hub id); slipstream generate and
    export read the local source from the weights file's metadata."""
    from test_gguf import _write_tiny_gguf

    gguf_file = tmp_path / SMOLLM2_FILE  # the demo file's name: its hub id is known
    _write_tiny_gguf(gguf_file, tie=True)
    model = slipstream.load_model(gguf_file)
    assert model.name_or_path == SMOLLM2_HUB and model.source == str(gguf_file)
    slipstream.apply_lora(model, rank=2, alpha=4)
    adapter = slipstream.save_adapter(model, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == SMOLLM2_HUB
    meta = safetensors_metadata(adapter / "adapter_model.safetensors")
    assert meta["slipstream.base_model"] == str(gguf_file)
    assert adapter_base(adapter) == str(gguf_file)  # still there: loaded offline
    gguf_file.unlink()
    assert adapter_base(adapter) == SMOLLM2_HUB  # gone: the hub id


def test_adapter_on_a_builtin_model_keeps_its_name(tmp_path, monkeypatch):
    """A built-in name stays a name in the adapter's metadata: it resolves on any machine."""
    from test_gguf import _write_tiny_gguf

    from slipstream.sources import BuiltinModel

    gguf_file = tmp_path / SMOLLM2_FILE
    _write_tiny_gguf(gguf_file, tie=True)
    monkeypatch.setattr(BuiltinModel, "path", lambda self: gguf_file)
    model = slipstream.load_model("smollm2-demo")
    slipstream.apply_lora(model, rank=2, alpha=4)
    adapter = slipstream.save_adapter(model, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == SMOLLM2_HUB
    assert adapter_base(adapter) == "smollm2-demo"


def test_save_adapter_from_python_records_the_source(tiny_run, tmp_path):
    model = slipstream.load_model(tiny_run[0])
    slipstream.apply_lora(model, rank=2, alpha=4)
    adapter = slipstream.save_adapter(model, tmp_path / "a")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_run[0])  # was null


def test_export_reads_base_carries_generation_config_and_fails_clean(tiny_run, tmp_path, capsys):
    from transformers import AutoConfig, GenerationConfig

    model = slipstream.load_model(tiny_run[0])
    slipstream.apply_lora(model, rank=2, alpha=4)
    adapter = slipstream.save_adapter(model, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert cli.main(["export", str(adapter), "--out", str(out)]) == 0  # no --base
    hf = json.loads((out / "config.json").read_text())
    assert hf["dtype"] == "float32" and "torch_dtype" not in hf  # transformers 5's key
    assert AutoConfig.from_pretrained(out).vocab_size == 300
    gen = GenerationConfig.from_pretrained(out)
    base = json.loads((tiny_run[0] / "config.json").read_text())
    assert gen.eos_token_id == base["eos_token_id"] and gen.pad_token_id is not None
    assert (out / "tokenizer.json").is_file()

    # A failed export (a base whose shapes do not fit the adapter) leaves no folder.
    other = tmp_path / "other"
    shutil.copytree(tiny_run[0], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    m = slipstream.load_model(tiny_run[0])
    m.model.layers = m.model.layers[:1]
    m.config.hf = {**m.config.hf, "num_hidden_layers": 1}
    slipstream.save_model(m, other)
    failed = tmp_path / "failed"
    assert cli.main(["export", str(adapter), "--base", str(other), "--out", str(failed)]) == 2
    assert not failed.exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    capsys.readouterr()


def test_export_merged_from_python_writes_the_tokenizer(tiny_run, tmp_path):
    model = slipstream.load_model(tiny_run[0])
    slipstream.apply_lora(model, rank=2, alpha=4)
    out = slipstream.export_merged(model, tmp_path / "m")
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_export_failing_midway_leaves_nothing(tiny_run, tmp_path, monkeypatch):
    import slipstream.checkpoint.export as export

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export, "passthrough_names", fail)  # after the weights are written
    model = slipstream.load_model(tiny_run[0])
    with pytest.raises(OSError):
        slipstream.export_merged(model, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_unknown_key_without_close_match_gets_no_suggestion(tiny_run, tmp_path, capsys):
    for key in ("train.foo", "model.bar", "data.blah", "lora.zzz", "train.qwerty"):
        assert closest_key(key) is None, key
    assert closest_key("data.trian") == "data.train" and closest_key("lora.rnak") == "lora.rank"
    assert closest_key("train.warmup") == "train.warmup_steps"
    config = write_yaml(tmp_path / "run.yaml", run_config(tiny_run, tmp_path / "out"))
    assert cli.main(["train", str(config), "train.foo=1"]) == 2
    assert error_line(capsys) == "slipstream: error: config: unknown key 'train.foo'"


def test_config_command_lists_every_key_with_meaning(capsys):
    assert cli.main(["config"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0].rstrip(":"): line for line in text.splitlines()}
    for key in valid_keys():
        leaf = key.rsplit(".", 1)[-1]
        assert leaf in rows, key
        assert len(rows[leaf].split()) >= 3, rows[leaf]  # name, default, meaning
    assert "tokens_per_batch" in rows and "8192" in rows["tokens_per_batch"]
    assert cli.main(["config", "nope"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "slipstream config" in capsys.readouterr().out


def test_row_problems_reported_before_the_empty_split(tiny_run, tmp_path, capsys):
    rows = [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}] * 10
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = run_config(tiny_run, tmp_path / "out")
    raw["data"] = {"train": str(data), "eval_fraction": 0.05}
    assert cli.main(["train", str(write_yaml(tmp_path / "r.yaml", raw))]) == 2
    err = error_line(capsys)
    assert "missing_field 10" in err and "empty split" not in err


def test_budget_under_every_example_names_the_setting(tiny_run, tmp_path, capsys):
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data import tokenize_rows

    config = write_yaml(tmp_path / "r.yaml", run_config(tiny_run, tmp_path / "out"))
    assert cli.main(["train", str(config), "train.tokens_per_batch=8", "data.eval_fraction=0"]) == 2
    err = error_line(capsys)
    assert "longer than train.tokens_per_batch = 8 tokens (the shortest has" in err
    examples, _ = tokenize_rows(chat_rows(48), load_tokenizer(str(tiny_run[0])), max_tokens=512)
    assert f"(the shortest has {min(map(len, examples))});" in err
    assert cli.main(["train", str(config), "data.max_tokens=9", "data.eval_fraction=0"]) == 2
    assert "longer than data.max_tokens = 9 tokens" in error_line(capsys)


def test_preview_shows_format_marked_example_and_plan(tiny_run, tmp_path, capsys, monkeypatch):
    import slipstream.train.setup as setup

    def no_model(*args, **kwargs):
        raise AssertionError("preview loaded the model")

    monkeypatch.setattr(setup, "build_model", no_model)
    import slipstream.checkpoint.hf

    monkeypatch.setattr(slipstream.checkpoint.hf, "load_model", no_model)
    config = write_yaml(tmp_path / "r.yaml", run_config(tiny_run, tmp_path / "out"))
    assert cli.main(["preview", str(config), "train.grad_accum=2"]) == 0
    out = capsys.readouterr().out
    assert f"source {tiny_run[1]}: format messages" in out
    # The first example (a shuffled split's first row) with only the reply bracketed.
    marked = [line for line in out.splitlines() if "[" in line and "[brackets]" not in line]
    assert marked and all(line.count("[") == 1 for line in marked)
    reply = marked[0][marked[0].index("[") + 1 : marked[0].index("]")]
    assert reply.startswith("The ") and reply.endswith("<|im_end|>")
    assert "rows 42: kept 42, skipped 0" in out  # 48 rows, 6 held out (eval_fraction 0.125)
    assert "packing:" in out and "% full" in out
    assert "grad_accum 2" in out and "train.steps = 6" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("color", [False, True])
def test_marked_text_marks_exactly_the_trained_tokens(tiny_run, color):
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data import tokenize_rows
    from slipstream.preview import GREEN, RESET, marked_text

    tokenizer = load_tokenizer(str(tiny_run[0]))
    (ex,), _ = tokenize_rows(chat_rows(1), tokenizer, max_tokens=512)
    text = marked_text(tokenizer, ex, color=color)
    start, end = (GREEN, RESET) if color else ("[", "]")
    inside = text[text.index(start) + len(start) : text.index(end)]
    trained = [t for t, keep in zip(ex.input_ids, ex.trainable, strict=True) if keep]
    assert inside == tokenizer.decode(trained)
    assert text.replace(start, "").replace(end, "") == tokenizer.decode(ex.input_ids)


def test_builtin_model_in_a_run_config(tmp_path):
    cfg = load_config(None, ["model.path=smollm2-demo", "data.train=x.jsonl", "output_dir=o"])
    from slipstream.sources import check_model_path

    check_model_path(cfg.model.path)  # resolves to the GGUF, no error


def test_readme_python_example_runs_and_labels_stay_in_their_sequence(tiny_run, tmp_path):
    """The README's hand-built step, on the tiny model: labels come per sequence from the
    collator (-100 at each sequence's end), never from shifting the packed stream."""
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```python\n")[1:]
    block = next(b.split("```")[0] for b in blocks if "collate(" in b)
    code = block.replace('"smollm2-demo"', repr(str(tiny_run[0]))).replace('"out/', f'"{tmp_path}/')
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    batch = scope["batch"]
    ends = [sum((7, 3, 12)[: i + 1]) - 1 for i in range(3)]
    assert [int(batch.labels[t]) for t in ends] == [-100, -100, -100]
    assert int(batch.labels[0]) == int(batch.input_ids[1])
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_slipstream_train_is_callable_whatever_was_imported_first():
    import slipstream.train.setup  # noqa: F401 (sets slipstream.train to the package)

    assert callable(slipstream.train)


def test_train_says_the_format_and_that_the_model_is_loading(tiny_run, tmp_path, capsys):
    import torch

    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.train.setup import build_data, build_model

    cfg = load_config(write_yaml(tmp_path / "r.yaml", run_config(tiny_run, tmp_path / "out")))
    build_data(cfg, load_tokenizer(cfg.model.path))
    build_model(cfg, torch.device("cpu"))
    err = capsys.readouterr().err
    assert "data (messages): 42 rows -> 42 examples" in err
    assert f"loading the model weights from {tiny_run[0]} (float32)..." in err
    assert "model loaded in" in err


def test_mixed_formats_counted_first_and_a_large_skip_is_a_warning(tiny_run, tmp_path, capsys):
    # A file of messages rows and prompt/completion rows: both read, each format counted in
    # preview's first lines and the run's data line; a quarter skipped is a warning line.
    chats = chat_rows(6)
    pairs = [{"prompt": m["messages"][0]["content"], "completion": m["messages"][1]["content"]}
             for m in chat_rows(4)]  # fmt: skip
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats + pairs))
    raw = run_config(tiny_run, tmp_path / "out")
    raw["data"] = {"train": str(data)}
    config = write_yaml(tmp_path / "r.yaml", raw)
    assert cli.main(["preview", str(config)]) == 0
    captured = capsys.readouterr()
    assert f"source {data}: format messages 6 rows, prompt_completion 4 rows" in captured.out
    assert "data (messages 6 rows, prompt_completion 4 rows): 10 rows -> 10 examples" in (
        captured.err
    )
    assert "warning" not in captured.err
    assert cli.main(["preview", str(config), "data.format=messages"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        f"slipstream: warning: data source '{data}' (train): 4 of 10 rows (40%) are not trained "
        "on (missing_field 4; first: row 6: missing_field: no 'messages')"
    ]
