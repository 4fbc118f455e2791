"""Run config: YAML + dotted overrides, and one-line errors that name the key."""

import os

import pytest
import yaml

from slipstream.config import (
    check_output_dir,
    closest_key,
    load_config,
    write_resolved_config,
)

BASE = {
    "model": {"path": "some/model"},
    "data": {"train": "train.jsonl", "eval_fraction": 0.1},
    "lora": {"rank": 8},
    "train": {"lr": 1e-3, "steps": 10},
    "output_dir": "out",
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return path


def test_yaml_and_defaults(config_file):
    cfg = load_config(config_file)
    assert cfg.lora.rank == 8 and cfg.lora.alpha == 32.0 and cfg.train.finetune == "lora"
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 10 and cfg.train.grad_accum == 1
    assert cfg.train.activation_checkpointing == "auto"
    assert cfg.model.quantization == "none" and cfg.resume is False


def test_overrides_use_yaml_scalar_rules(config_file):
    cfg = load_config(
        config_file,
        ["train.lr=1e-4", "lora.rank=32", "lora.targets=[q_proj, v_proj]", "train.clip=null",
         "resume=true", "data.train=other.data.jsonl", "train.finetune=full"],
    )  # fmt: skip
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.lora.rank == 32
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.train.clip is None
    assert cfg.resume is True
    assert cfg.data.train == "other.data.jsonl"
    assert cfg.train.finetune == "full"


@pytest.mark.parametrize("how", ["yaml", "override"])
def test_the_old_lora_method_key_still_works_with_one_notice(tmp_path, capsys, how):
    """`lora.method` moved to `train.finetune`: the old spelling gives the same config and
    one deprecation line naming the new key."""
    raw = {**BASE, "lora": {"rank": 8, "method": "full"}} if how == "yaml" else BASE
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path, ["lora.method=full"] if how == "override" else [])
    assert cfg.train.finetune == "full" and cfg.lora.rank == 8
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slipstream: lora.method is deprecated; write train.finetune: full instead"]
    assert "method" not in cfg.model_dump()["lora"]
    # Both spellings agreeing is fine; disagreeing is one line naming both.
    assert load_config(path, ["train.finetune=full", "lora.method=full"]).train.finetune == "full"
    with pytest.raises(ValueError, match="lora.method='lora' and train.finetune='full' disagree"):
        load_config(path, ["train.finetune=full", "lora.method=lora"])


def test_a_config_saved_before_the_move_reads_silently(capsys):
    """Checkpoints keep the config they were trained with: an old one (lora.method) reads
    as the new, with no notice (export and resume read it)."""
    from slipstream.config import RunConfig, config_from_dict, moved_keys

    old = config_from_dict({**BASE, "train": {"finetune": "full"}}).model_dump(mode="json")
    old["lora"]["method"] = old["train"].pop("finetune")
    capsys.readouterr()
    cfg = RunConfig.model_validate(moved_keys(old, say=False))
    assert cfg.train.finetune == "full" and "method" in old["lora"]  # the input is kept
    assert capsys.readouterr().err == ""


def test_override_creates_missing_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "train"}))
    cfg = load_config(path, ["train.tokens_per_batch=512"])
    assert cfg.train.tokens_per_batch == 512


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("train.lrr=1", "train.lrr", "train.lr"),
        ("lora.rnak=4", "lora.rnak", "lora.rank"),
        ("train.warmup=5", "train.warmup", "train.warmup_steps"),
        ("outptu_dir=x", "outptu_dir", "output_dir"),
        ("tokens_per_batch=64", "tokens_per_batch", "train.tokens_per_batch"),
        ("train.learning_rate=1e-4", "train.learning_rate", "train.lr"),
        ("lora.lora_alpha=16", "lora.lora_alpha", "lora.alpha"),
    ],
)
def test_unknown_key_names_it_and_suggests(config_file, override, key, hint):
    with pytest.raises(ValueError) as e:
        load_config(config_file, [override])
    msg = str(e.value)
    assert f"unknown key '{key}'" in msg and f"did you mean '{hint}'" in msg
    assert "\n" not in msg


def test_unknown_key_in_yaml_file(tmp_path):
    raw = {**BASE, "lora": {"rank": 8, "alpah": 16}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"unknown key 'lora.alpah' \(did you mean 'lora.alpha'"):
        load_config(path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=-1e-4", "train.lr"),
        ("lora.rank=0", "lora.rank"),
        ("train.tokens_per_batch=0", "train.tokens_per_batch"),
        ("train.tokens_per_batch=-5", "train.tokens_per_batch"),
        ("train.grad_accum=0", "train.grad_accum"),
        ("data.eval_fraction=1.5", "data.eval_fraction"),
        ("train.schedule=step", "train.schedule"),
        ("lora.rank=abc", "lora.rank"),
        ("train.activation_checkpointing=sometimes", "train.activation_checkpointing"),
    ],
)
def test_bad_values_name_the_key(config_file, override, key):
    with pytest.raises(ValueError) as e:
        load_config(config_file, [override])
    msg = str(e.value)
    assert msg.startswith(f"config: {key}:"), msg
    assert "\n" not in msg


def test_missing_required_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "output_dir"}))
    with pytest.raises(ValueError, match="missing required key 'output_dir'"):
        load_config(path)


def test_eval_file_and_fraction_exclusive(config_file):
    """A data.eval override on a config with eval_fraction: one short line saying which to
    drop, not the data section dumped."""
    with pytest.raises(ValueError) as e:
        load_config(config_file, ["data.eval=held.jsonl"])
    msg = str(e.value)
    assert "data.eval and data.eval_fraction are both set; drop one" in msg
    assert "data.eval_fraction=0" in msg and "got" not in msg and "{" not in msg


def test_malformed_override_and_files(config_file, tmp_path):
    with pytest.raises(ValueError, match="key=value"):
        load_config(config_file, ["train.lr"])
    with pytest.raises(ValueError, match="'train.lr' is a value"):
        load_config(config_file, ["train.lr.x=1"])
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips(config_file, tmp_path):
    cfg = load_config(config_file, ["train.lr=3e-4"])
    written = write_resolved_config(cfg, tmp_path)
    again = load_config(written)
    assert again == cfg


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_dir_as_user(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        check_output_dir(locked / "run")


def test_output_dir_under_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir '.*' is not writable"):
        check_output_dir(blocker / "run")


def test_closest_key():
    assert closest_key("train.seeed") == "train.seed"
    assert closest_key("zzzzzz") is None


def test_example_configs_validate():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        cfg = load_config(path)
        assert cfg.output_dir


def test_config_command_lists_every_choice():
    # `slipstream config` names the values of every key that has a fixed set: the objectives
    # of the registry and each Literal's values (read here from the models, not copied).
    import re
    import typing

    from slipstream.config import RunConfig, _section_type, describe_config
    from slipstream.objectives import OBJECTIVES

    def choices(annotation):
        if typing.get_origin(annotation) is typing.Literal:
            return list(typing.get_args(annotation))
        return [c for arg in typing.get_args(annotation) for c in choices(arg)]

    checked = 0
    for name, field in RunConfig.model_fields.items():
        section = _section_type(field.annotation)
        if section is None:
            continue
        lines = {line.split()[0]: line for line in describe_config(name).splitlines()[1:]}
        for key, f in section.model_fields.items():
            wanted = (
                list(OBJECTIVES) if (name, key) == ("train", "objective") else choices(f.annotation)
            )
            for value in wanted:
                assert re.search(rf"(?<![\w-]){value}(?![\w-])", lines[key]), (key, value)
                checked += 1
    assert checked > 30


def test_data_folder_is_ignored_but_no_tracked_folder(tmp_path):
    # configs/smollm2_dpo.yaml's helper writes data/pairs/ at the repository root.
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        run = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root)
        return run.returncode == 0

    assert ignored("data/pairs/train.jsonl")
    assert not ignored("tests/data/rows.jsonl") and not ignored("slipstream/data/formats.py")


def test_off_reads_as_off_in_a_file_and_an_override(tmp_path):
    """YAML 1.1 reads a bare `off` as False: `train.memory: off` and `train.mlp_tiles=off`
    (as README writes them) were errors ("Input should be 'check', 'auto' or 'off' (got
    False)"); they mean "off". `true` is still an error."""
    raw = {**BASE, "train": {**BASE.get("train", {}), "memory": "REPLACE", "mlp_tiles": "REPLACE"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw).replace("REPLACE", "off"))
    cfg = load_config(path)
    assert (cfg.train.memory, cfg.train.mlp_tiles) == ("off", "off")
    cfg = load_config(path, ["train.memory=auto", "train.mlp_tiles=off"])
    assert (cfg.train.memory, cfg.train.mlp_tiles) == ("auto", "off")
    with pytest.raises(ValueError, match="train.memory"):
        load_config(path, ["train.memory=true"])
