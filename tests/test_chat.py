"""`slipstream chat`: the loop and its commands driven by scripted input with a stand-in
model (generation/chat.py), then through the CLI on a tiny model with a Ctrl-C injected into
the streamed reply."""

from __future__ import annotations

import io

import pytest
from transformers import AutoTokenizer

import slipstream
from slipstream import cli
from slipstream.generation.chat import chat_loop


def scripted(*lines):
    """A `read` that returns the lines in turn (raising any exception among them), then EOF."""
    it = iter(lines)

    def read(prompt: str) -> str:
        line = next(it, EOFError)
        if isinstance(line, type) and issubclass(line, BaseException):
            raise line
        return line

    return read


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


class Model:
    """Replies r1, r2, ... streamed in two pieces; records the messages each reply saw."""

    def __init__(self, interrupt: dict[int, int] | None = None):
        self.seen: list[list[dict]] = []
        self.interrupt = interrupt or {}  # reply number -> pieces shown before a Ctrl-C

    def __call__(self, messages, on_text):
        self.seen.append(messages)
        n = len(self.seen)
        pieces = [f"r{n}", "!"]
        for k, piece in enumerate(pieces):
            if self.interrupt.get(n) == k:
                raise KeyboardInterrupt
            on_text(piece)
        return "".join(pieces)


def test_commands_empty_lines_and_exit_are_not_sent():
    model, out = Model(), io.StringIO()
    lines = ["Hi", "", "   ", "/system", "/system Be brief.", "What?", "/help", "/nope",
             "/reset", "Again", "exit", "never read"]  # fmt: skip
    history = chat_loop(model, system="S0", read=scripted(*lines), out=out)
    assert model.seen == [
        [system("S0"), user("Hi")],
        [system("Be brief."), user("Hi"), assistant("r1!"), user("What?")],
        [system("Be brief."), user("Again")],  # /reset keeps the system message
    ]
    assert history == [system("Be brief."), user("Again"), assistant("r3!")]
    text = out.getvalue()
    assert "(system message: S0)" in text and "(system message set)" in text
    assert "/reset" in text and "/system TEXT" in text  # /help
    assert "(unknown command /nope; /help lists the commands)" in text
    assert "(conversation reset)" in text
    assert text.count("assistant> ") == 3


@pytest.mark.parametrize("end", ["/exit", "/quit", "/EXIT", "quit", EOFError])
def test_each_way_to_end_the_chat(end):
    model = Model()
    chat_loop(model, read=scripted("Hi", end, "not sent"), out=io.StringIO())
    assert model.seen == [[user("Hi")]]


def test_ctrl_c_stops_the_reply_and_keeps_the_history():
    """Reply 1 is stopped after one piece: that piece stays as the assistant's turn. Reply 2
    is stopped before any text: its message is taken back. Ctrl-C at the prompt re-prompts."""
    model, out = Model(interrupt={1: 1, 2: 0}), io.StringIO()
    read = scripted("Hi", "Second", KeyboardInterrupt, "Third", "/exit")
    history = chat_loop(model, read=read, out=out)
    assert model.seen[1] == [user("Hi"), assistant("r1"), user("Second")]
    assert model.seen[2] == [user("Hi"), assistant("r1"), user("Third")]
    assert history == [user("Hi"), assistant("r1"), user("Third"), assistant("r3!")]
    text = out.getvalue()
    assert "assistant> r1 [stopped]\n" in text
    assert "assistant> [stopped; message dropped]\n" in text
    assert "(Ctrl-D or /exit ends the chat)" in text


def test_chat_cli_answers_after_an_empty_line_and_a_ctrl_c(tiny_run, monkeypatch, capsys):
    """`printf 'Hi\\n\\nWhat?\\n/exit\\n...' | slipstream chat`, a Ctrl-C raised from the
    streamer (the stop check's text callback) in the first reply: the chat goes on, and the
    second reply is the API's for the history with the part of the first shown."""
    import slipstream.generation.api as api

    model_dir = tiny_run[0]
    grow, calls = api._Texts.grow, []

    def grow_then_ctrl_c(self, i, row):
        calls.append(1)
        if len(calls) == 2:  # the second stop check of the first reply
            raise KeyboardInterrupt
        return grow(self, i, row)

    monkeypatch.setattr(api._Texts, "grow", grow_then_ctrl_c)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\nWhat?\n/exit\nnot sent\n"))
    assert cli.main(["chat", str(model_dir), "--max-new-tokens", "7"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("assistant> ")[1:]
    partial = first.split(" [stopped]\n")[0]
    assert partial and " [stopped]\n" in first  # two tokens' text, then the stop
    model = slipstream.load_model(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    history = [user("Hi"), assistant(partial), user("What?")]
    ref = slipstream.generate(model, [history], tokenizer=tok, max_new_tokens=7)[0].text
    assert second.split("\n")[0] == ref
    assert out.count("assistant> ") == 2  # /exit ended it: "not sent" was not


def test_chat_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for command in ("/exit, /quit", "/reset", "/system TEXT", "/help", "Ctrl-C during a reply"):
        assert command in text, command
