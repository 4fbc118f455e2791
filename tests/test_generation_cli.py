"""`slipstream generate` (sampling flags, jsonl batch mode) and `slipstream chat` (streamed)
against the Python API on a tiny model."""

from __future__ import annotations

import io
import json

import pytest
from transformers import AutoTokenizer

import slipstream
from slipstream import cli


def _api(model_dir, prompts, **kw):
    model = slipstream.load_model(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return slipstream.generate(model, prompts, tokenizer=tok, **kw), tok


def test_generate_sampling_flags_equal_the_api(tiny_run, capsys):
    model_dir = tiny_run[0]
    flags = ["--max-new-tokens", "9", "--temperature", "0.9", "--top-k", "50", "--seed", "4"]
    assert cli.main(["generate", str(model_dir), "Hello there", *flags]) == 0
    msgs = [{"role": "user", "content": "Hello there"}]
    ref, _ = _api(model_dir, [msgs], max_new_tokens=9, temperature=0.9, top_k=50, seed=4)
    assert capsys.readouterr().out.strip() == ref[0].text.strip()


def test_generate_jsonl_batch(tiny_run, tmp_path, capsys):
    model_dir = tiny_run[0]
    rows = [{"prompt": "What color is the sky?"},
            {"messages": [{"role": "user", "content": "Hi!"}]},
            {"input_ids": [5, 9, 14]}]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    argv = ["generate", str(model_dir), "--input", str(src), "--output", str(out),
            "--max-new-tokens", "6", "--batch-size", "2", "--num-return-sequences", "2",
            "--temperature", "1", "--seed", "0", "--logprobs"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "6 completions of 3 prompts" in capsys.readouterr().out
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(g["line"], g["sample"]) for g in got] == [
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    # Batches of 2 prompts: the first batch equals the API on those two prompts.
    msgs = [{"role": "user", "content": rows[0]["prompt"]}]
    ref, tok = _api(model_dir, [msgs, rows[1]["messages"]], max_new_tokens=6, temperature=1.0,
                    seed=0, num_return_sequences=2, return_logprobs=True)  # fmt: skip
    for g, r in zip(got[:4], ref, strict=True):
        assert (g["token_ids"], g["text"], g["finish_reason"]) == (
            r.token_ids,
            r.text,
            r.finish_reason,
        )
        assert g["logprobs"] == r.logprobs
    assert all(len(g["logprobs"]) == len(g["token_ids"]) for g in got)

    src.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert cli.main(["generate", str(model_dir), "--input", str(src), "--output", str(out)]) == 2
    assert "in.jsonl:2: give an object with 'prompt'" in capsys.readouterr().err
    assert cli.main(["generate", str(model_dir)]) == 2
    assert "give one prompt" in capsys.readouterr().err


def test_chat_streams_replies_over_turns(tiny_run, monkeypatch, capsys):
    model_dir = tiny_run[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd then?\n"))
    assert cli.main(["chat", str(model_dir), "--max-new-tokens", "7"]) == 0
    out = capsys.readouterr().out
    first = [{"role": "user", "content": "Hi!"}]
    ref1, _ = _api(model_dir, [first], max_new_tokens=7)
    second = [*first, {"role": "assistant", "content": ref1[0].text},
              {"role": "user", "content": "And then?"}]  # fmt: skip
    ref2, _ = _api(model_dir, [second], max_new_tokens=7)
    replies = [part.split("\n")[0] for part in out.split("assistant> ")[1:]]
    assert replies == [ref1[0].text, ref2[0].text]


def test_prompts_file_with_a_byte_order_mark(tmp_path):
    from slipstream.generation.commands import read_jsonl

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "Hi"}\n{"prompt": "Bye"}\n')
    assert read_jsonl(path) == [(1, {"prompt": "Hi"}), (2, {"prompt": "Bye"})]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_batch_output_folder_is_created_and_input_fields_kept(tiny_run, tmp_path, capsys):
    """--output in a folder that does not exist yet; each output row keeps its input row's
    fields (an "id", the prompt itself) beside the completion."""
    model_dir = tiny_run[0]
    rows = [{"id": "a-1", "prompt": "What color is the sky?", "meta": {"k": [1, 2]}},
            {"id": 7, "messages": [{"role": "user", "content": "Hi!"}]}]  # fmt: skip
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out" / "sub" / "gen.jsonl"
    argv = ["generate", str(model_dir), "--input", str(src), "--output", str(out),
            "--max-new-tokens", "4", "--num-return-sequences", "2"]  # fmt: skip
    assert cli.main(argv) == 0
    assert f"4 completions of 2 prompts written to {out}" in capsys.readouterr().out
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["a-1", "a-1", 7, 7]
    assert got[0]["meta"] == {"k": [1, 2]} and got[0]["prompt"] == rows[0]["prompt"]
    assert got[2]["messages"] == rows[1]["messages"]
    assert [(g["line"], g["sample"]) for g in got] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(isinstance(g["text"], str) and g["token_ids"] for g in got)
    assert not (out.parent / "gen.jsonl.partial").exists()


def test_batch_failure_keeps_the_finished_prompts(tiny_run, tmp_path, monkeypatch, capsys):
    """A Ctrl-C (or any failure) in the second batch: the first batch's completions are in
    OUT.partial, OUT itself is untouched, and a line says where they are."""
    import slipstream.generation.api as api

    model_dir = tiny_run[0]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"n {i}"} for i in range(3)])
    out = tmp_path / "gen.jsonl"
    out.write_text("an earlier file\n")
    real, calls = api.generate_rows, []

    def interrupted_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "generate_rows", interrupted_second_batch)
    argv = ["generate", str(model_dir), "--input", str(src), "--output", str(out),
            "--max-new-tokens", "3", "--batch-size", "2"]  # fmt: skip
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    partial = tmp_path / "gen.jsonl.partial"
    assert f"stopped after 2 of 3 prompts; their completions are in {partial}" in err
    assert [json.loads(x)["id"] for x in partial.read_text().splitlines()] == [0, 1]
    assert out.read_text() == "an earlier file\n"


@pytest.mark.parametrize(
    "args, said",
    [
        (["Hi", "--num-return-sequences", "0"], "--num-return-sequences is 0; give at least 1"),
        (["Hi", "--temperature", "-1"], "--temperature is -1.0; give 0 (greedy) or more"),
        (["Hi", "--top-p", "2"], "--top-p is 2.0; give a value in (0, 1]"),
        (["Hi", "--top-k", "-3"], "--top-k is -3; give 0 (off) or a positive count"),
        (["Hi", "--max-new-tokens", "0"], "--max-new-tokens is 0; give at least 1"),
        (["Hi", "--stop", ""], "--stop is an empty string"),
        ([""], "the prompt is empty"),
        (["  \n"], "the prompt is empty"),
        (["--input", "IN", "--output", "OUT", "--batch-size", "0"], "--batch-size is 0"),
        (["Hi", "--output", "OUT"], "--output is for a file of prompts"),
        (["--input", "EMPTY_PROMPT", "--output", "OUT"], "e.jsonl:2: 'prompt' must be a non-empty"),
        (["--input", "CLASH", "--output", "OUT"], "c.jsonl:1: field 'text' is also an output"),
        (["--input", "IN", "--output", "DIR"], "is a folder; give a file such as"),
        (["--input", "IN", "--output", "UNDER_FILE"], "--output: cannot create the folder"),
    ],
)  # fmt: skip
def test_bad_flags_and_rows_exit_2_before_any_model_load(
    tiny_run, tmp_path, monkeypatch, capsys, args, said
):
    import slipstream.checkpoint.hf as hf
    import slipstream.checkpoint.tokenizer as tokenizer_module

    def no_load(*a, **k):
        raise AssertionError("a model or tokenizer loaded before the arguments were checked")

    monkeypatch.setattr(hf, "load_model", no_load)
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", no_load)
    (tmp_path / "a_file").write_text("")
    files = {
        "IN": _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ok"}]),
        "EMPTY_PROMPT": _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok"}, {"prompt": ""}]),
        "CLASH": _write_jsonl(tmp_path / "c.jsonl", [{"prompt": "ok", "text": "gold"}]),
        "OUT": tmp_path / "out.jsonl",
        "DIR": tmp_path,
        "UNDER_FILE": tmp_path / "a_file" / "out.jsonl",
    }
    argv = ["generate", str(tiny_run[0]), *[str(files.get(a, a)) for a in args]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("slipstream: error: ") and said in err and "\n" not in err, err
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.partial").exists()
    # chat checks its sampling flags before loading too
    assert cli.main(["chat", str(tiny_run[0]), "--top-p", "0"]) == 2
    assert "--top-p is 0.0" in capsys.readouterr().err
