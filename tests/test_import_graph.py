"""No import cycle between slipstream's parts (its subpackages and top-level modules), nor
between the modules inside a part.

Every `import slipstream.X...` / `from slipstream.X... import` counts, also those inside
functions: a lazy import hides a cycle from Python, not from a reader. `slipstream/__init__.py`
(the public API, which imports every part) is left out. Between modules, `from P import n`
depends on P's `__init__.py` (it reads P's namespace) and on `P.n` when that is a module;
`import P.n` and `from P.n import x` depend on `P.n` alone.
"""

import ast
from pathlib import Path

import slipstream

ROOT = Path(slipstream.__file__).parent


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "slipstream" and len(parts) > 1 else None


def _imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "slipstream":  # from slipstream import peft
                found.update(f"slipstream.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return found


def import_graph() -> dict[str, dict[str, str]]:
    """part -> {imported part: a file that imports it}."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel == Path("__init__.py"):
            continue
        src = rel.parts[0].removesuffix(".py")
        for module in _imports(ast.parse(path.read_text())):
            dst = _part(module)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, str(rel))
    return graph


def module_name(rel: Path) -> str:
    """slipstream/peft/lora.py -> slipstream.peft.lora; a package's __init__.py -> the package."""
    parts = ("slipstream", *rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module `source` (module `name`) names in an import, lazy ones too; relative
    imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*package, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def module_graph() -> dict[str, dict[str, str]]:
    """module -> {slipstream module it imports: the importing file}."""
    files = {module_name(p.relative_to(ROOT)): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        if name == "slipstream":
            continue
        rel = str(path.relative_to(ROOT))
        for module in module_imports(path.read_text(), name, path.name == "__init__.py"):
            if module in files and module not in ("slipstream", name):
                graph.setdefault(name, {})[module] = rel
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        for nxt in graph.get(node, {}):
            cycle = visit(nxt, [*stack, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node, [])
        if cycle:
            return cycle
    return None


def test_no_import_cycle_between_parts():
    graph = import_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle: " + "; ".join(where)


def test_no_import_cycle_between_modules():
    graph = module_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle: " + "; ".join(where)


def test_module_imports_sees_lazy_package_and_relative_imports():
    source = (
        "import slipstream.train.sharded as sharded\n"
        "from slipstream.train import state\n"
        "def f():\n"
        "    from slipstream.peft.dora import DoRALinear\n"
        "    from .names import PEFT_PREFIX\n"
    )
    found = module_imports(source, "slipstream.peft.lora")
    assert {"slipstream.train.sharded", "slipstream.peft.dora", "slipstream.peft.names"} <= found
    assert {"slipstream.train", "slipstream.train.state"} <= found  # the package's __init__ too
    assert module_imports("from . import lora", "slipstream.peft", is_package=True) >= {
        "slipstream.peft.lora"
    }
    graph = module_graph()
    assert "slipstream.peft.lora_linear" in graph["slipstream.peft.dora"]
    assert "slipstream.checkpoint.gguf_llama3" in graph["slipstream.checkpoint.gguf_families"]


def test_checkpoint_uses_peft_and_models_not_the_reverse():
    graph = import_graph()
    assert {"models", "peft"} <= set(graph["checkpoint"])
    assert "checkpoint" not in graph["peft"] and "checkpoint" not in graph.get("models", {})
    assert "peft" not in graph.get("models", {})


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": "x"}, "b": {}}) is None
