"""`slipstream chat`: the read-reply loop and its commands (no torch here: `respond` is given).

A line is a message to the model unless it is one of COMMANDS; an empty line is ignored.
Ctrl-C during a reply stops it and returns to the prompt: the part of the reply already shown
stays in the history as the assistant's turn (so the model knows what it said; "go on" makes
it continue), and when nothing was shown yet the message is dropped with it (chat templates
expect user and assistant turns to alternate). Ctrl-C at the prompt says how to leave.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

COMMANDS = """\
chat commands (a line that is not one of them is a message to the model):
  /exit, /quit     end the chat (so do `exit`, `quit` and Ctrl-D)
  /reset           forget the conversation (the system message stays)
  /system TEXT     set the system message (replaces --system); /system alone shows it
  /help            list these commands
An empty line is ignored. Ctrl-C during a reply stops the reply and keeps the part shown."""

EXIT = ("/exit", "/quit", "exit", "quit")
# messages -> reply text; calls on_text(new_text) as the reply grows (streaming)
Respond = Callable[[list[dict], Callable[[str], None]], str]


def chat_loop(
    respond: Respond,
    *,
    system: str | None = None,
    read: Callable[[str], str] = input,
    out: TextIO | None = None,
) -> list[dict]:
    """Read a line, run a command or stream the model's reply, until /exit or end of input.
    Returns the conversation (the messages the next reply would see)."""
    out = out or sys.stdout
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            text = read("you> ").strip()
        except EOFError:
            print(file=out)
            return messages
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit ends the chat)", file=out)
            continue
        if not text:
            continue
        if text.lower() in EXIT:
            return messages
        if text.startswith("/"):
            messages = command(text, messages, out)
            continue
        messages.append({"role": "user", "content": text})
        messages += reply(respond, messages, out)


def reply(respond: Respond, messages: list[dict], out: TextIO) -> list[dict]:
    """The assistant turn to add: the whole reply, the part shown before Ctrl-C, or none
    (Ctrl-C before any text: the user's message is taken back too)."""
    shown: list[str] = []

    def show(new: str) -> None:
        shown.append(new)
        print(new, end="", flush=True, file=out)

    print("assistant> ", end="", flush=True, file=out)
    try:
        text = respond(list(messages), show)
    except KeyboardInterrupt:
        text = "".join(shown)
        print(" [stopped]" if text else "[stopped; message dropped]", file=out)
        if not text:
            messages.pop()
            return []
        return [{"role": "assistant", "content": text}]
    print(file=out)
    return [{"role": "assistant", "content": text}]


def command(text: str, messages: list[dict], out: TextIO) -> list[dict]:
    """Run a /command; returns the conversation after it."""
    name, _, arg = text.partition(" ")
    name, arg = name.lower(), arg.strip()
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    if name == "/reset":
        print("(conversation reset)", file=out)
        return system
    if name == "/system":
        if not arg:
            said = system[0]["content"] if system else "none"
            print(f"(system message: {said})", file=out)
            return messages
        print("(system message set)", file=out)
        return [{"role": "system", "content": arg}, *messages[len(system) :]]
    if name == "/help":
        print(COMMANDS, file=out)
    else:
        print(f"(unknown command {name}; /help lists the commands)", file=out)
    return messages
