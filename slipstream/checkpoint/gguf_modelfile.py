"""An Ollama Modelfile for an exported GGUF: FROM, TEMPLATE, stop tokens.

Ollama templates are Go templates, not Jinja. We render the GGUF's Jinja chat template on
marker messages and cut the result around the markers: what comes before and after each
role's content becomes that role's branch of a Go template, and what the template adds for
the reply (`add_generation_prompt`) ends it. This covers the templates that wrap each message
in fixed text (ChatML, Llama 3, Gemma, Phi-3, Mistral [INST]); a template it cannot cut is
left out with a comment, and Ollama falls back to the template it detects in the GGUF.
"""

from __future__ import annotations

from pathlib import Path

MARK = "\x00{}\x00"


def modelfile_text(gguf_path: Path) -> str:
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields

    def get(key):
        f = fields.get(key)
        return None if f is None else f.contents()

    tokens = get("tokenizer.ggml.tokens") or []
    template = get("tokenizer.chat_template")

    def token(key):
        i = get(key)
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else ""

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    lines = [f"FROM ./{gguf_path.name}", ""]
    go = go_template(template, bos, eos) if template else None
    if go is None:
        lines.append("# no TEMPLATE: the chat template could not be turned into Ollama's form")
    else:
        lines.append(f'TEMPLATE """{go}"""')
    stops = [s for s in dict.fromkeys([eos, *_end_markers(template, bos, eos)]) if s]
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def _render(template: str, messages: list[dict], bos: str, eos: str, prompt: bool) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    out = env.from_string(template).render(
        messages=messages, bos_token=bos, eos_token=eos, add_generation_prompt=prompt
    )
    return out.removeprefix(bos) if bos else out  # llama.cpp/Ollama add BOS themselves


def _pieces(template: str, bos: str, eos: str) -> dict[str, tuple[str, str]] | None:
    """{role: (text before its content, text after)}, and the reply opener under 'reply'.

    Chats of growing length (system, user, assistant), each cut where the previous one ends;
    a template that refuses a system message (or injects a default one) is cut without it.
    The reply opener is what add_generation_prompt appends after the user turn."""

    def render(roles: list[str], prompt: bool = False) -> str:
        chat = [{"role": r, "content": MARK.format(r)} for r in roles]
        return _render(template, chat, bos, eos, prompt)

    for roles in (["system", "user", "assistant"], ["user", "assistant"]):
        out: dict[str, tuple[str, str]] = {}
        try:
            done = ""
            for i, role in enumerate(roles):
                text = render(roles[: i + 1])
                before, found, after = text.partition(MARK.format(role))
                if not found or not text.startswith(done) or MARK[0] in before[len(done) :]:
                    raise ValueError("not cuttable")
                out[role] = (before[len(done) :], after)
                done = text
            asked = render(roles[:-1])
            reply = render(roles[:-1], prompt=True)
        except Exception:
            continue
        if reply.startswith(asked) and not any(MARK[0] in a + b for a, b in out.values()):
            out["reply"] = ("", reply[len(asked) :])
            return out
    return None


def go_template(template: str, bos: str, eos: str) -> str | None:
    pieces = _pieces(template, bos, eos)
    if pieces is None:
        return None
    parts = ["{{- range .Messages }}"]
    first = True
    for role in ("system", "user", "assistant"):
        if role not in pieces:
            continue
        before, after = pieces[role]
        cond = "if" if first else "else if"  # no "{{-": it would eat the newlines we keep
        parts.append(f'{{{{ {cond} eq .Role "{role}" }}}}{before}{{{{ .Content }}}}{after}')
        first = False
    parts.append("{{ end }}{{ end }}")
    parts.append(pieces["reply"][1])
    return "".join(parts)


def _end_markers(template: str | None, bos: str, eos: str) -> list[str]:
    """The assistant turn's closing special text (e.g. <|im_end|>, <|eot_id|>)."""
    if not template:
        return []
    pieces = _pieces(template, bos, eos)
    if pieces is None or "assistant" not in pieces:
        return []
    end = pieces["assistant"][1].strip()
    return [end] if end else []
