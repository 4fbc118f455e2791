"""`data.train` as a list of sources: each is loaded, format-detected, split and tokenized on
its own, then pooled; a bad source is named in the error."""

from __future__ import annotations

import json

import pytest
from helpers.runs import chat_rows, run_config

from slipstream.checkpoint.tokenizer import load_tokenizer
from slipstream.config import config_from_dict, load_config
from slipstream.train.setup import build_data


def _alpaca_rows(n: int) -> list[dict]:
    return [
        {"instruction": f"Count to {i % 7 + 2}.", "input": "", "output": " ".join(
            str(k) for k in range(1, i % 7 + 3))}
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture
def sources(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(24)))
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps(_alpaca_rows(16)))
    return str(chats), str(alpaca)


def _data(tiny_run, tmp_path, train, **data):
    raw = run_config(tiny_run, tmp_path / "out")
    raw["data"] = {"train": train, "eval_fraction": 0.25, **data}
    cfg = config_from_dict(raw)
    return build_data(cfg, load_tokenizer(cfg.model.path))


def test_sources_of_different_formats_are_pooled(tiny_run, tmp_path, sources):
    chats, alpaca = sources
    both = _data(tiny_run, tmp_path, [chats, alpaca])
    one, two = _data(tiny_run, tmp_path, chats), _data(tiny_run, tmp_path, alpaca)
    ids = [e.input_ids for e in both.train]
    assert ids == [e.input_ids for e in one.train] + [e.input_ids for e in two.train]
    assert len(both.train) == 18 + 12 and len(both.eval) == 6 + 4  # each source split 3:1
    assert both.report.rows == 30 and both.report.kept == 30
    packed = sorted(i for batch in both.train_batches for i in batch)
    assert packed == list(range(len(both.train)))  # every pooled example in one batch


def test_a_bad_source_is_named(tiny_run, tmp_path, sources):
    chats, _ = sources
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"messages": [{"role": "user"}]}) + "\n" for _ in range(8)))
    with pytest.raises(ValueError, match=r"data source '.*bad\.jsonl' \(train\)"):
        _data(tiny_run, tmp_path, [chats, str(bad)])


def test_source_lists_in_yaml_and_overrides(tmp_path, sources):
    chats, alpaca = sources
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: m}}\ndata: {{train: {chats}}}\noutput_dir: out\n")
    cfg = load_config(path, [f"data.train=[{chats}, {alpaca}]", f"data.eval=[{alpaca}]"])
    assert cfg.data.train == [chats, alpaca] and cfg.data.eval == [alpaca]
    for train in ([], [chats, chats]):
        with pytest.raises(ValueError, match="one or more sources, each once"):
            load_config(path, [f"data.train={json.dumps(train)}"])
