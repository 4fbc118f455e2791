"""A small Go text/template renderer: the subset Ollama Modelfile TEMPLATEs use, so tests can
render what we write and compare it with the tokenizer's own chat template.

Supported: text; `{{ PIPE }}`; `{{- ... -}}` whitespace trimming; `if` / `else if` / `else` /
`end`; `range $i, $x := PIPE` and `range PIPE`; `$v := PIPE`; operands `.`, `.Field`,
`$.Field`, `$v`, `$v.Field`, "strings", integers, `(PIPE)`; functions eq, ne, and, or, not,
len, slice, index. Anything else raises, so a template outside the subset cannot pass quietly.
"""

from __future__ import annotations

import ast
import re
from typing import Any

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\(|\)|\$?[\w.]*|\S)')


def render(template: str, data: dict) -> str:
    nodes = _parse(_lex(template))
    out: list[str] = []
    _run(nodes, data, {"$": data}, data, out)
    return "".join(out)


def _lex(template: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)] with Go's trimming applied to the text around."""
    items: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        items.append(("text", text))
        items.append(("action", m.group(2).strip()))
        pos, trim_next = m.end(), bool(m.group(3))
    text = template[pos:]
    items.append(("text", text.lstrip() if trim_next else text))
    return items


def _parse(items: list[tuple[str, str]]) -> list:
    """Nodes: ("text", s), ("expr", body), ("assign", name, body),
    ("if", [(cond, nodes), ...], else_nodes), ("range", vars, body, nodes)."""
    stack: list[list] = [[]]
    frames: list[dict] = []
    for kind, body in items:
        if kind == "text":
            stack[-1].append(("text", body))
            continue
        word = body.split(None, 1)[0] if body else ""
        rest = body[len(word) :].strip()
        if word == "if":
            frames.append({"kind": "if", "branches": [(rest, [])], "else": None})
            stack.append(frames[-1]["branches"][0][1])
        elif word == "else":
            frame = frames[-1]
            stack.pop()
            if rest.startswith("if "):
                frame["branches"].append((rest[3:].strip(), []))
                stack.append(frame["branches"][-1][1])
            else:
                frame["else"] = []
                stack.append(frame["else"])
        elif word == "range":
            m = re.fullmatch(r"(?:(\$\w+)\s*(?:,\s*(\$\w+))?\s*:=\s*)?(.+)", rest, re.S)
            frames.append({"kind": "range", "vars": (m.group(1), m.group(2)), "pipe": m.group(3),
                           "nodes": []})  # fmt: skip
            stack.append(frames[-1]["nodes"])
        elif word == "end":
            stack.pop()
            frame = frames.pop()
            if frame["kind"] == "if":
                stack[-1].append(("if", frame["branches"], frame["else"] or []))
            else:
                stack[-1].append(("range", frame["vars"], frame["pipe"], frame["nodes"]))
        elif re.match(r"\$\w+\s*:=", body):
            name, pipe = body.split(":=", 1)
            stack[-1].append(("assign", name.strip(), pipe.strip()))
        else:
            stack[-1].append(("expr", body))
    if frames:
        raise ValueError(f"unclosed {frames[-1]['kind']}")
    return stack[0]


def _run(nodes: list, dot: Any, scope: dict, root: Any, out: list[str]) -> None:
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "expr":
            out.append(_str(_eval(node[1], dot, scope)))
        elif kind == "assign":
            scope[node[1]] = _eval(node[2], dot, scope)
        elif kind == "if":
            for cond, body in node[1]:
                if _truth(_eval(cond, dot, scope)):
                    _run(body, dot, dict(scope), root, out)
                    break
            else:
                _run(node[2], dot, dict(scope), root, out)
        elif kind == "range":
            (index_var, value_var), pipe, body = node[1], node[2], node[3]
            for i, item in enumerate(_eval(pipe, dot, scope) or []):
                inner = dict(scope)
                if index_var and value_var:
                    inner[index_var], inner[value_var] = i, item
                elif index_var:
                    inner[index_var] = item
                _run(body, item, inner, root, out)


def _eval(pipe: str, dot: Any, scope: dict) -> Any:
    tokens = [t for t in _TOKEN.findall(pipe) if t]
    value, rest = _call(tokens, dot, scope)
    if rest:
        raise ValueError(f"unsupported template expression {pipe!r}")
    return value


def _call(tokens: list[str], dot: Any, scope: dict) -> tuple[Any, list[str]]:
    """A command: a function with its arguments, or one operand; up to ')' or the end."""
    head, rest = tokens[0], tokens[1:]
    if head in FUNCTIONS:
        args = []
        while rest and rest[0] != ")":
            arg, rest = _operand(rest, dot, scope)
            args.append(arg)
        return FUNCTIONS[head](*args), rest
    return _operand(tokens, dot, scope)


def _operand(tokens: list[str], dot: Any, scope: dict) -> tuple[Any, list[str]]:
    head, rest = tokens[0], tokens[1:]
    if head == "(":
        value, rest = _call(rest, dot, scope)
        if not rest or rest[0] != ")":
            raise ValueError("unbalanced parentheses in template")
        return value, rest[1:]
    if head.startswith('"'):
        return ast.literal_eval(head), rest
    if re.fullmatch(r"-?\d+", head):
        return int(head), rest
    if head.startswith("$"):
        name, _, path = head.partition(".")
        if name not in scope:
            raise ValueError(f"undefined variable {name}")
        return _field(scope[name], path), rest
    if head.startswith("."):
        return _field(dot, head[1:]), rest
    raise ValueError(f"unsupported template operand {head!r}")


def _field(value: Any, path: str) -> Any:
    for name in filter(None, path.split(".")):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


def _truth(v: Any) -> bool:
    return bool(v)


def _str(v: Any) -> str:
    return "" if v is None else str(v)


def _and(*args: Any) -> Any:
    for a in args:
        if not _truth(a):
            return a
    return args[-1]


def _or(*args: Any) -> Any:
    for a in args:
        if _truth(a):
            return a
    return args[-1]


FUNCTIONS = {
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": lambda a, b: a != b,
    "and": _and,
    "or": _or,
    "not": lambda a: not _truth(a),
    "len": len,
    "slice": lambda x, *ij: x[ij[0] : ij[1]] if len(ij) == 2 else x[ij[0] :] if ij else x,
    "index": lambda x, *keys: _index(x, keys),
}


def _index(x: Any, keys: tuple) -> Any:
    for k in keys:
        x = x[k]
    return x
