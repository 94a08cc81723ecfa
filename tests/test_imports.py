"""The package's import graph has no cycle, and ``import jax_mla`` loads no kernel library.

The graph counts every import statement of every module (at module level and inside
functions), ``importlib.import_module`` calls with a literal name, and the registry's lazy
``"module:Class"`` entries, as edges from module to module: ``from pkg import mod`` is an edge to
``pkg.mod``, ``from mod import name`` an edge to ``mod`` (a package's ``__init__`` counts only
where its own names are imported). ``python tests/test_imports.py [ROOT]``
prints the graph's strongly connected components of more than one module (none on main).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(root: Path = ROOT, package: str = "jax_mla") -> dict[str, set[str]]:
    """``{module: {modules it imports}}`` over ``package`` (edges inside the package only)."""
    modules = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph = {m: set() for m in modules}

    def resolve(name: str) -> str | None:
        # The longest prefix that is one of our modules ("a.b.c" may name a function in a.b).
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in modules:
                return cand
        return None

    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "import_module" and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith(package + ".") and ":" in node.value:
                names = [node.value.split(":")[0]]  # a lazy registry entry "module:Class"
            for n in names:
                target = resolve(n)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_function_level_and_lazy_imports():
    g = import_graph()
    # A function-level import (kernel sources are loaded when a call is traced).
    assert "jax_mla.kernels.triton.decode" in g["jax_mla.backends.triton.decode"]
    # The registry's lazy entries are edges too.
    assert "jax_mla.backends.aiter" in g["jax_mla.backends"]


def test_import_loads_no_kernel_library_nor_the_aiter_backend():
    code = ("import sys, jax_mla; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'jax_triton', 'aiter') or m.startswith('jax_mla.backends.aiter'))"
            "; print(bad); sys.exit(1 if bad else 0)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    g = import_graph(root)
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} edges")
    for comp in cycles(g):
        print(f"cycle of {len(comp)}: {', '.join(comp)}")
