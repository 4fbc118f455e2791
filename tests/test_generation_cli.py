"""`slipstream generate` (sampling flags, jsonl batch mode) and `slipstream chat` (streamed)
against the Python API on a tiny model."""

from __future__ import annotations

import io
import json

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
