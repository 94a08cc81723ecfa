"""BUILD matches the tree.

The top-level ``BUILD`` file names the package, its test support and every test module in
explicit lists. These tests read it without Bazel (Starlark's call-and-list subset is valid
Python syntax, evaluated here by a tiny interpreter over ``ast``; nothing is executed) and
check that:

* every file a target names exists, and ends in ``.py`` (``.cc`` / ``.h`` for ``cc_binary``);
* every module under ``jax_mla/`` is in a ``py_library``, every ``tests/test_*.py`` is a
  ``py_test``, every other ``.py`` file under ``tests/`` and ``benchmarks/`` is named
  by some target, and every C++ file under ``ffi/`` is in a ``cc_binary`` that the package
  carries as data;
* every ``py_test``'s main source is a ``tests/test_*.py`` file;
* every dependency label points at a target defined in ``BUILD``.

A failure message lists every problem at once, each with the exact text to add to or
remove from ``BUILD``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "BUILD"

RULES = ("py_library", "py_binary", "py_test", "cc_binary")
CC_SUFFIXES = (".cc", ".h")
ALLOWED_CALLS = RULES + ("package",)
LIB_DEPS = '[":jax_mla"]'
TEST_DEPS = '[":jax_mla", ":test_support"]'


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str
    name: str
    attrs: dict
    line: int

    @property
    def where(self) -> str:
        return f'{self.kind}(name = "{self.name}") at BUILD line {self.line}'

    def files(self, attr: str) -> list[str]:
        return [_file_label(x) for x in self.attrs.get(attr, [])]


def _file_label(label: str) -> str:
    """A file label in the root package (``x``, ``:x`` or ``//:x``) as a path."""
    for prefix in ("//:", ":"):
        if label.startswith(prefix):
            return label[len(prefix) :]
    return label


def _dep_name(label: str) -> str | None:
    """The target name of a label in the root package, or None for anything else."""
    for prefix in ("//:", ":"):
        if label.startswith(prefix):
            return label[len(prefix) :]
    return None


class BuildError(ValueError):
    pass


def _value(node: ast.AST, env: dict):
    """Evaluate the literal subset BUILD may use: strings, ints, bools, lists, +, names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, bool)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, env) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _value(node.left, env), _value(node.right, env)
        if type(left) is not type(right):
            raise BuildError(f"BUILD line {node.lineno}: '+' of {type(left)} and {type(right)}")
        return left + right
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise BuildError(f"BUILD line {node.lineno}: undefined name {node.id!r}")
        return env[node.id]
    raise BuildError(
        f"BUILD line {getattr(node, 'lineno', '?')}: unsupported expression "
        f"{ast.unparse(node)!r} (use explicit lists of strings: no glob(), no select())"
    )


def parse_build(text: str) -> list[Target]:
    """The targets a BUILD text defines (native py rules, package(), NAME = value only)."""
    try:
        tree = ast.parse(text, filename="BUILD")
    except SyntaxError as e:
        raise BuildError(f"BUILD line {e.lineno}: not parseable: {e.msg}") from None
    env: dict = {}
    targets: list[Target] = []
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            env[stmt.targets[0].id] = _value(stmt.value, env)
            continue
        if not (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)
        ):
            raise BuildError(f"BUILD line {stmt.lineno}: only rule calls and NAME = value")
        call = stmt.value
        kind = call.func.id
        if kind not in ALLOWED_CALLS:
            raise BuildError(
                f"BUILD line {call.lineno}: {kind}() is not allowed; use only the native "
                f"{', '.join(ALLOWED_CALLS)} (no load(), so `bazel query` needs no network)"
            )
        if call.args or any(kw.arg is None for kw in call.keywords):
            raise BuildError(f"BUILD line {call.lineno}: {kind}() takes keyword arguments only")
        attrs = {kw.arg: _value(kw.value, env) for kw in call.keywords}
        if kind == "package":
            continue
        name = attrs.get("name")
        if not isinstance(name, str) or not name:
            raise BuildError(f"BUILD line {call.lineno}: {kind}() without a name")
        for attr in ("srcs", "data", "deps"):
            value = attrs.get(attr, [])
            if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
                raise BuildError(
                    f"BUILD line {call.lineno}: {attr} of {name!r} must be a list of strings"
                )
        targets.append(Target(kind, name, attrs, call.lineno))
    return targets


@pytest.fixture(scope="module")
def targets() -> list[Target]:
    assert BUILD.is_file(), f"{BUILD} is missing"
    return parse_build(BUILD.read_text())


def _report(problems: list[str]) -> None:
    if problems:
        pytest.fail(
            "BUILD is out of date with the tree:\n\n" + "\n\n".join(problems), pytrace=False
        )


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _py_files(folder: str) -> list[str]:
    base = ROOT / folder
    if not base.is_dir():
        return []
    return sorted(
        _rel(p)
        for p in base.rglob("*.py")
        if "__pycache__" not in p.parts and not any(s.startswith(".") for s in p.parts)
    )


def _is_test_file(path: str) -> bool:
    return path.startswith("tests/test_") and path.endswith(".py") and path.count("/") == 1


def _test_block(path: str) -> str:
    name = path[len("tests/") : -len(".py")]
    return f'py_test(\n    name = "{name}",\n    srcs = ["{path}"],\n    deps = {TEST_DEPS},\n)'


def _binary_block(path: str) -> str:
    name = Path(path).stem
    return f'py_binary(\n    name = "{name}",\n    srcs = ["{path}"],\n    deps = {LIB_DEPS},\n)'


def _main_source(t: Target) -> tuple[str | None, str]:
    """Bazel's choice of main for a py_test/py_binary: `main`, else `<name>.py`, in srcs."""
    main = _file_label(t.attrs.get("main", f"{t.name}.py"))
    matches = [s for s in t.files("srcs") if s == main or s.endswith("/" + main)]
    return (matches[0] if len(matches) == 1 else None), main


def test_target_names_are_unique(targets):
    seen: dict[str, Target] = {}
    problems = []
    for t in targets:
        if t.name in seen:
            problems.append(f"{t.where}: the name is already used by {seen[t.name].where}")
        seen.setdefault(t.name, t)
    _report(problems)


def test_named_files_exist(targets):
    problems = []
    names = {t.name for t in targets}
    for t in targets:
        for attr in ("srcs", "data"):
            files = t.files(attr)
            for path in files:
                if attr == "data" and path in names:
                    continue  # a target's output (the FFI library), not a source file
                if not (ROOT / path).is_file():
                    problems.append(
                        f'{t.where} names "{path}" in {attr}, which does not exist.\n'
                        f'Remove the line\n    "{path}",\nfrom its {attr} (or the whole '
                        f"target if that was its only file)."
                    )
                elif attr == "srcs" and t.kind == "cc_binary":
                    if not path.endswith(CC_SUFFIXES):
                        problems.append(f'{t.where}: srcs entry "{path}" is not a C++ file')
                elif attr == "srcs" and not path.endswith(".py"):
                    problems.append(f'{t.where}: srcs entry "{path}" is not a .py file')
            for path in sorted({p for p in files if files.count(p) > 1}):
                problems.append(f'{t.where} names "{path}" twice in {attr}; remove one')
    _report(problems)


def test_every_module_is_covered(targets):
    in_library = {p for t in targets if t.kind == "py_library" for p in t.files("srcs")}
    in_test = {p for t in targets if t.kind == "py_test" for p in t.files("srcs")}
    anywhere = {p for t in targets for a in ("srcs", "data") for p in t.files(a)}
    by_name = {t.name: t for t in targets}
    problems = []

    def add_to(lib: str, path: str) -> str:
        where = by_name[lib].where if lib in by_name else f'py_library(name = "{lib}")'
        return (
            f"{path} is not named by any BUILD target. Add the line\n"
            f'    "{path}",\nto the srcs of {where}.'
        )

    for path in _py_files("jax_mla"):
        if path not in in_library:
            problems.append(add_to("jax_mla", path))
    for path in _py_files("tests"):
        if _is_test_file(path):
            if path not in in_test:
                problems.append(
                    f"{path} has no py_test target. Add to BUILD (after the other py_test "
                    f"targets):\n\n{_test_block(path)}"
                )
        elif path not in anywhere:
            problems.append(add_to("test_support", path))
    for path in _py_files("benchmarks"):
        if path not in anywhere:
            problems.append(
                f"{path} is not named by any BUILD target. Add to BUILD (with the other "
                f"benchmarks):\n\n{_binary_block(path)}"
            )
    _report(problems)


def test_every_ffi_source_is_built_and_carried(targets):
    """The FFI launcher's sources are one shared library's, which the package lists as data."""
    in_cc = {p: t for t in targets if t.kind == "cc_binary" for p in t.files("srcs")}
    sources = sorted(_rel(p) for p in (ROOT / "ffi").rglob("*") if p.suffix in CC_SUFFIXES)
    problems = [f"{path} is not in any cc_binary's srcs; add it to the srcs of the FFI "
                f"library's cc_binary" for path in sources if path not in in_cc]
    data = set(next((t.attrs.get("data", []) for t in targets if t.name == "jax_mla"), []))
    for t in {id(t): t for t in in_cc.values()}.values():
        if not t.attrs.get("linkshared"):
            problems.append(f"{t.where}: set linkshared = True (it is loaded as a library)")
        if f":{t.name}" not in data:
            problems.append(f'{t.where}: add ":{t.name}" to the data of py_library "jax_mla"')
    assert sources, "ffi/ has no C++ sources"
    _report(problems)


def test_py_test_mains_are_test_files(targets):
    problems = []
    tested: dict[str, Target] = {}
    for t in targets:
        if t.kind not in ("py_test", "py_binary"):
            continue
        src, main = _main_source(t)
        if src is None:
            problems.append(
                f'{t.where}: its main "{main}" matches no single srcs entry; name the target '
                f'after its file or set main = "<the file in srcs>"'
            )
            continue
        if t.kind != "py_test":
            continue
        if not _is_test_file(src):
            problems.append(f'{t.where}: main source "{src}" is not a tests/test_*.py file')
        elif src in tested:
            problems.append(f'{t.where}: "{src}" is already the main of {tested[src].where}')
        tested.setdefault(src, t)
    _report(problems)


def test_dependency_labels_resolve(targets):
    by_name = {t.name: t for t in targets}
    problems = []
    for t in targets:
        for label in t.attrs.get("deps", []):
            name = _dep_name(label)
            if name is None:
                problems.append(
                    f'{t.where}: dependency "{label}" is not a target of this BUILD '
                    f'(external repositories are not used; write ":name")'
                )
            elif name not in by_name:
                problems.append(
                    f'{t.where}: dependency "{label}" names no target; defined targets: '
                    f"{', '.join(sorted(by_name))}"
                )
            elif by_name[name].kind != "py_library":
                problems.append(f'{t.where}: dependency "{label}" is a {by_name[name].kind}')
            elif (
                by_name[name].attrs.get("testonly")
                and t.kind != "py_test"
                and not t.attrs.get("testonly")
            ):
                problems.append(
                    f'{t.where} depends on testonly "{label}"; only tests (or testonly targets) may'
                )
    _report(problems)


def test_parser_rejects_what_bazel_would_need_the_network_or_a_glob_for():
    with pytest.raises(BuildError, match="load"):
        parse_build('load("@rules_python//python:defs.bzl", "py_library")\n')
    with pytest.raises(BuildError, match="glob"):
        parse_build('py_library(name = "x", srcs = glob(["*.py"]))\n')
    parsed = parse_build(
        'DEPS = [":a"]\npackage(default_visibility = ["//visibility:public"])\n'
        'py_library(name = "a", srcs = ["a.py"])\n'
        'py_test(name = "test_b", srcs = ["tests/test_b.py"], deps = DEPS + [":c"])\n'
    )
    assert [(t.kind, t.name, t.line) for t in parsed] == [
        ("py_library", "a", 3),
        ("py_test", "test_b", 4),
    ]
    assert parsed[1].attrs["deps"] == [":a", ":c"]
