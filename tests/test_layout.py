"""The package's shape: no import circle among mlxcel_dist's modules (imports
inside functions count: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlxcel_dist"
# Circles not yet taken apart: empty (keep it so) as they go.
KNOWN: list = []


def _modules() -> dict:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, f: Path, modules: dict) -> set:
    """The package's modules that `name` imports, anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
            mod = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `from . import x` names a module; `from .m import f` a name in m
                t = t.rpartition(".")[0]
            if t and t not in (name, "mlxcel_dist"):
                found.add(t)
    return found


def circles(graph: dict) -> list[set]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_circles_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    modules = _modules()
    assert "mlxcel_dist.serve.openai_api" in modules and "mlxcel_dist.models.base" in modules
    graph = {name: _imports(name, f, modules) for name, f in modules.items()}
    assert "mlxcel_dist.parallel.pipeline" in graph["mlxcel_dist.checkpoint.loader"]  # function-level imports are seen
    found = circles(graph)
    assert [c for c in found if c not in KNOWN] == [], found


def test_every_package_is_in_the_wheel():
    # pyproject lists its packages by name (the default model is mapped in), so a package added
    # under mlxcel_dist/ and not listed would be missing from an installed wheel, not an editable install
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(f.parent.relative_to(PACKAGE.parent).parts) for f in PACKAGE.rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
