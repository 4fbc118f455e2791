"""An Ollama Modelfile for an exported GGUF: FROM, TEMPLATE, stop tokens.

Ollama templates are Go templates, not Jinja. We render the GGUF's Jinja chat template on
marker messages and cut the result around the markers: what comes before and after each
role's content becomes that role's branch of a Go template, and what the template adds for
the reply (`add_generation_prompt`) follows the last message when it is not the assistant's.
Text the template puts before a chat that does not open with a system message (SmolLM2's and
Qwen's default system prompt) is written under `if` the first message is not a system one.
The cut is checked by composing longer chats from the pieces and comparing them with the
Jinja rendering. This covers the templates that wrap each message in fixed text (ChatML,
Llama 3, Gemma, Phi-3, Mistral [INST]); a template it cannot cut is left out with a comment,
and Ollama falls back to the template it detects in the GGUF.

The BOS token is cut from the front of a rendering only when the GGUF says llama.cpp adds it
(`tokenizer.ggml.add_bos_token`, true when absent): SmolLM2's BOS is `<|im_start|>` with
add_bos_token false, so stripping it there broke the first turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MARK = "\x00{}\x00"
ROLES = ("system", "user", "assistant")


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
    adds_bos = get("tokenizer.ggml.add_bos_token")
    adds_bos = True if adds_bos is None else bool(adds_bos)
    cut = ChatTemplateCut.of(template, bos, eos, adds_bos) if template else None
    lines = [f"FROM ./{gguf_path.name}", ""]
    if cut is None:
        lines.append("# no TEMPLATE: the chat template could not be turned into Ollama's form")
    else:
        lines.append(f'TEMPLATE """{cut.go_template()}"""')
    end = cut.pieces["assistant"][1].strip() if cut is not None else ""
    stops = [s for s in dict.fromkeys([eos, end]) if s]
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n"


def render_chat(
    template: str, messages: list[dict], bos: str, eos: str, prompt: bool, strip_bos: bool
) -> str:
    """The Jinja chat template's text for `messages` (the BOS cut when llama.cpp adds it)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    out = env.from_string(template).render(
        messages=messages, bos_token=bos, eos_token=eos, add_generation_prompt=prompt
    )
    return out.removeprefix(bos) if bos and strip_bos else out


@dataclass
class ChatTemplateCut:
    """A chat template as fixed text around each role's content: `pieces[role] = (before,
    after)`, `reply` (what add_generation_prompt appends) and `default` (text before a chat
    whose first message is not a system message: a default system turn, or "")."""

    pieces: dict[str, tuple[str, str]]
    reply: str
    default: str

    @classmethod
    def of(cls, template: str, bos: str, eos: str, adds_bos: bool) -> ChatTemplateCut | None:
        def render(roles: list[str], prompt: bool = False) -> str:
            chat = [{"role": r, "content": MARK.format(r)} for r in roles]
            return render_chat(template, chat, bos, eos, prompt, strip_bos=adds_bos)

        # A template that refuses a system message is cut without one.
        for roles in (["system", "user", "assistant"], ["user", "assistant"]):
            try:
                cut = cls._cut(render, roles)
                if cut is not None and cut._composes(render, "system" in roles):
                    return cut
            except Exception:  # jinja's own errors, raise_exception: try the next way
                continue
        return None

    @classmethod
    def _cut(cls, render, roles: list[str]) -> ChatTemplateCut | None:
        """Chats of growing length, each cut where the previous one ends."""
        pieces: dict[str, tuple[str, str]] = {}
        done = ""
        for i, role in enumerate(roles):
            text = render(roles[: i + 1])
            before, found, after = text.partition(MARK.format(role))
            if not found or not text.startswith(done) or MARK[0] in before[len(done) :]:
                return None
            pieces[role] = (before[len(done) :], after)
            done = text
        asked, reply = render(roles[:-1]), render(roles[:-1], prompt=True)
        if not reply.startswith(asked) or any(MARK[0] in a + b for a, b in pieces.values()):
            return None
        default = ""
        if "system" in pieces:  # what a chat without a system message gets in front
            alone = render(["user"])
            user = pieces["user"][0] + MARK.format("user") + pieces["user"][1]
            if not alone.endswith(user) or MARK[0] in alone[: -len(user)]:
                return None
            default = alone[: -len(user)]
        return cls(pieces, reply[len(asked) :], default)

    def compose(self, roles: list[str], prompt: bool) -> str:
        """What the Go template renders for a chat of these roles (contents: the markers);
        `prompt`: the reply opener after a last message that is not the assistant's."""
        out = [self.default] if roles and roles[0] != "system" else []
        for role in roles:
            before, after = self.pieces.get(role, ("", ""))
            out.append(before + MARK.format(role) + after if role in self.pieces else "")
        if prompt and roles and roles[-1] != "assistant":
            out.append(self.reply)
        return "".join(out)

    def _composes(self, render, system: bool) -> bool:
        """Longer chats than those cut, composed from the pieces, equal the Jinja rendering."""
        chats = [["user", "assistant", "user"], ["user"]]
        if system:
            chats.append(["system", "user", "assistant", "user"])
        return all(
            self.compose(c, prompt=p) == render(c, prompt=p) for c in chats for p in (False, True)
        )

    def go_template(self) -> str:
        """`compose` as a Go template over Ollama's `.Messages`."""
        branches = []
        for role in ROLES:
            if role in self.pieces:
                before, after = self.pieces[role]
                cond = "if" if not branches else "else if"  # no "{{-": it eats our newlines
                branches.append(
                    f'{{{{ {cond} eq .Role "{role}" }}}}{before}{{{{ .Content }}}}{after}'
                )
        parts = ["{{- range $i, $_ := .Messages }}",
                 "{{ $last := eq (len (slice $.Messages $i)) 1 }}"]  # fmt: skip
        if self.default:
            parts.append(
                f'{{{{ if and (eq $i 0) (ne .Role "system") }}}}{self.default}{{{{ end }}}}'
            )
        parts += [*branches, "{{ end }}"]
        if self.reply:
            parts.append(f'{{{{ if and $last (ne .Role "assistant") }}}}{self.reply}{{{{ end }}}}')
        parts.append("{{ end }}")
        return "".join(parts)
