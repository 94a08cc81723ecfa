"""The pinned AITER API (``jax_mla/backends/aiter/manifest.json``) against our code and stand-in.

- the manifest is valid JSON pinned to a full ROCm/aiter commit (the one capabilities.py cites);
- the stand-in (``tests/aiter_standin``) has exactly the pinned signatures;
- every AITER name ``jax_mla/backends/aiter/*.py`` references is in the manifest (a new call
  without an entry fails here), and every call the bridge makes binds to the pinned signature;
- an altered signature is reported, naming the function and the difference;
- on a ROCm host with AITER installed, the installed AITER has the pinned signatures.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types

import pytest

import jax_mla.backends.aiter as aiter_pkg
from jax_mla.backends.aiter import manifest

from aiter_standin.harness import STANDIN_DIR, standin

PKG_DIR = os.path.dirname(os.path.abspath(aiter_pkg.__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(PKG_DIR)))
KINDS = {"POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY",
         "VAR_KEYWORD"}


# ---------------------------------------------------------------------------------------------
# The manifest itself


def test_manifest_is_valid_json_and_pinned():
    with open(manifest.MANIFEST_PATH, encoding="utf-8") as f:
        data = json.load(f)
    assert data == manifest.load_manifest()
    assert data["source"] == "ROCm/aiter"
    assert re.fullmatch(r"[0-9a-f]{40}", data["aiter_commit"]), data["aiter_commit"]
    # The commit the capability tables cite (capabilities.py: "at ROCm/aiter <short hash>").
    with open(os.path.join(PKG_DIR, "capabilities.py"), encoding="utf-8") as f:
        cited = re.search(r"ROCm/aiter ([0-9a-f]{7,40})\b", f.read()).group(1)
    assert data["aiter_commit"].startswith(cited)
    assert data["functions"], "no functions pinned"
    for name, entry in {**data["functions"], **data.get("fallbacks", {})}.items():
        assert name.startswith("aiter."), name
        assert entry["file"].startswith("aiter/") and entry["file"].endswith(".py"), name
        names = [p["name"] for p in entry["params"]]
        assert len(set(names)) == len(names), name
        for p in entry["params"]:
            assert p["kind"] in KINDS, (name, p)
            assert set(p) <= {"name", "kind", "annotation", "default", "default_expr",
                              "default_source"}, (name, p)
            if "default" in p:
                ast.literal_eval(p["default"])  # a repr Python can read back
        manifest.signature(name)  # a valid Python signature (order of defaults, kinds)
    for name, entry in data.get("fallbacks", {}).items():
        assert entry["fallback_for"] in data["functions"], name
        assert re.fullmatch(r"[0-9a-f]{40}", entry["last_commit"]), name
    for name, entry in data.get("attributes", {}).items():
        assert name.startswith("aiter.") and entry["file"].startswith("aiter/"), name
    for name, entry in data.get("triton_kernels", {}).items():
        assert name.startswith("aiter.") and entry["file"].startswith("aiter/"), name
        assert entry["file"] == name.rsplit(".", 1)[0].replace(".", "/") + ".py", name
        assert any(d.startswith(("triton.jit", "gluon.jit")) for d in entry["decorators"]), name
        assert {"grid", "num_warps", "num_stages"} <= set(entry["launch"]), name
        names = [p["name"] for p in entry["params"]]
        assert len(set(names)) == len(names), name
        for p in entry["params"]:
            assert p["kind"] == "POSITIONAL_OR_KEYWORD", (name, p)
            assert set(p) <= {"name", "kind", "annotation", "default"}, (name, p)
            assert p.get("annotation", "constexpr") in ("constexpr", "int32", "int64"), (name, p)
            if "default" in p:
                ast.literal_eval(p["default"])


def test_manifest_ships_with_the_package():
    # setuptools' own reading of pyproject.toml (its package-data goes into wheels and sdists).
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    cfg = pyprojecttoml.read_configuration(os.path.join(ROOT, "pyproject.toml"))
    assert "manifest.json" in cfg["tool"]["setuptools"]["package-data"]["jax_mla.backends.aiter"]


def test_manifest_module_imports_neither_torch_nor_aiter():
    code = ("import sys, jax_mla, jax_mla.backends.aiter.manifest as m; m.load_manifest(); "
            "bad = sorted(k for k in ('torch', 'aiter') if k in sys.modules); "
            "sys.exit(f'imported {bad}' if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# The stand-in


def test_standin_matches_the_manifest():
    with standin() as aiter:
        assert manifest.check_module(aiter) == []


def test_standin_files_are_where_aiter_has_them():
    # The stand-in mirrors AITER's defining files for the submodule functions we import by path.
    data = manifest.load_manifest()
    for name, entry in {**data["functions"], **data.get("triton_kernels", {})}.items():
        if name.count(".") > 1:  # aiter.<module path>.<function>
            path = os.path.join(STANDIN_DIR, *name.split(".")[:-1]) + ".py"
            assert entry["file"] == os.path.relpath(path, STANDIN_DIR).replace(os.sep, "/")
            assert os.path.exists(path), path


# ---------------------------------------------------------------------------------------------
# Our code: every AITER name it references, every call it makes


class _Scan(ast.NodeVisitor):
    """The ``aiter.*`` names a module references, and its calls to them.

    Follows: ``import aiter...``/``from aiter... import f [as g]`` (a try/except fallback
    import of the same local name keeps the first, primary binding); ``importlib.import_module(
    "aiter...")``; a local name assigned one of those; a module-level function returning one
    (``_aiter()``, ``_get_mla_gluon()``); attribute chains on any of them; string probes
    ``f("aiter...", "name", ...)``. Dunder attributes (``aiter.__file__``) are not API.
    """

    def __init__(self, returns=None):
        self.envs = [{}]
        self.returns = dict(returns or {})
        self.found_returns = {}
        self.refs = []  # (dotted, lineno)
        self.calls = []  # (dotted, Call node, enclosing top-level def)
        self.funcs = []

    @property
    def env(self):
        return self.envs[-1]

    def dotted(self, node):
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            if base is None or node.attr.startswith("__"):
                return None
            return f"{base}.{node.attr}"
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "import_module" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] == "aiter"):
                return node.args[0].value
            if isinstance(f, ast.Name) and f.id not in self.env:
                return self.returns.get(f.id)
        return None

    def visit_FunctionDef(self, node):
        self.envs.append(dict(self.env))
        self.funcs.append(node)
        self.generic_visit(node)
        self.funcs.pop()
        self.envs.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] == "aiter":
                self.refs.append((a.name, node.lineno))
                if a.asname:
                    self.env.setdefault(a.asname, a.name)
                else:
                    self.env.setdefault("aiter", "aiter")

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module and node.module.split(".")[0] == "aiter":
            for a in node.names:
                d = f"{node.module}.{a.name}"
                self.refs.append((d, node.lineno))
                self.env.setdefault(a.asname or a.name, d)

    def visit_Assign(self, node):
        self.visit(node.value)
        d = self.dotted(node.value)
        if d is not None:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.env[t.id] = d
        for t in node.targets:
            self.visit(t)

    def visit_Return(self, node):
        if node.value is not None:
            self.visit(node.value)
            d = self.dotted(node.value)
            if d is not None and self.funcs:
                self.found_returns.setdefault(self.funcs[0].name, d)

    def visit_Attribute(self, node):
        d = self.dotted(node)
        if d is not None:
            self.refs.append((d, node.lineno))
        else:
            self.generic_visit(node)

    def visit_Call(self, node):
        d = self.dotted(node.func)
        if d is not None:
            self.refs.append((d, node.lineno))
            self.calls.append((d, node, self.funcs[0] if self.funcs else None))
        else:
            self.visit(node.func)
        strs = [a.value for a in node.args if isinstance(a, ast.Constant)
                and isinstance(a.value, str)]
        if (len(strs) >= 2 and len(strs) == len(node.args)
                and strs[0].split(".")[0] == "aiter"):
            self.refs.extend((f"{strs[0]}.{n}", node.lineno) for n in strs[1:])
        for a in node.args:
            self.visit(a)
        for k in node.keywords:
            self.visit(k.value)


def _sources():
    out = []
    for fn in sorted(os.listdir(PKG_DIR)):
        if fn.endswith(".py") and fn != "manifest.py":
            with open(os.path.join(PKG_DIR, fn), encoding="utf-8") as f:
                out.append((fn, ast.parse(f.read())))
    return out


def _scan(tree):
    first = _Scan()
    first.visit(tree)
    scan = _Scan(first.found_returns)
    scan.visit(tree)
    return scan


def _known(data):
    return set(data["functions"]) | set(data.get("attributes", {})) | set(
        data.get("fallbacks", {})) | set(data.get("triton_kernels", {}))


def _accepted(name, known):
    # A module on the way to a pinned name (``aiter``, ``aiter.mla``, ``aiter.dtypes``) is fine.
    return name in known or any(k.startswith(name + ".") for k in known)


def test_scanner_sees_the_bridge_calls():
    # Guard the guard: the scan must see what we know the bridge calls.
    scan = _scan(dict(_sources())["bridge.py"])
    called = {d for d, _, _ in scan.calls}
    for name in ("aiter.mla.mla_decode_fwd", "aiter.get_mla_metadata_v1",
                 "aiter.mla_prefill_ps_asm_fwd", "aiter.mla_reduce_v1",
                 "aiter.flash_attn_varlen_func", "aiter.ops.triton.attention.mla.mla_decode_fwd",
                 "aiter.ops.triton.gluon.mla_gluon.mla_gluon"):
        assert name in called, name
    refs = {d for d, _ in scan.refs}
    assert "aiter.ops.triton.gluon.mla_decode_gluon.mla_decode_gluon" in refs
    assert "aiter.dtypes" in refs


def test_every_aiter_name_our_code_uses_is_in_the_manifest():
    data = manifest.load_manifest()
    known = _known(data)
    unknown = []
    for fn, tree in _sources():
        for name, line in _scan(tree).refs:
            if not _accepted(name, known):
                unknown.append(f"jax_mla/backends/aiter/{fn}:{line}: {name}")
    assert not unknown, ("AITER names used but not pinned in manifest.json (add them from the "
                         "pinned ROCm/aiter commit):\n" + "\n".join(unknown))


def test_every_pinned_function_is_used():
    # No stale entries: each pinned function is referenced by our code.
    data = manifest.load_manifest()
    used = {name for _, tree in _sources() for name, _ in _scan(tree).refs}
    stale = [n for n in [*data["functions"], *data.get("fallbacks", {}),
                         *data.get("triton_kernels", {})] if n not in used]
    assert not stale, stale


def _kw_keys(func, name):
    """Keyword names that ``**name`` spreads in ``func``: ``name = dict(k=..)``, ``{"k": ..}``
    (either arm of a conditional) and ``name.update(k=..)``; None when not all are literal."""
    keys = set()

    def from_expr(v):
        if isinstance(v, ast.IfExp):
            return from_expr(v.body) and from_expr(v.orelse)
        if isinstance(v, ast.Dict) and all(isinstance(k, ast.Constant) for k in v.keys):
            keys.update(k.value for k in v.keys)
            return True
        if (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict"
                and not v.args and all(k.arg for k in v.keywords)):
            keys.update(k.arg for k in v.keywords)
            return True
        return False

    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if not from_expr(node.value):
                return None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == name):
            if node.args or not all(k.arg for k in node.keywords):
                return None
            keys.update(k.arg for k in node.keywords)
    return keys


def test_bridge_calls_bind_to_the_pinned_signatures():
    data = manifest.load_manifest()
    fallbacks = {e["fallback_for"]: n for n, e in data.get("fallbacks", {}).items()}
    checked, problems = 0, []
    for fn, tree in _sources():
        for name, call, func in _scan(tree).calls:
            if name not in data["functions"] and name not in data.get("fallbacks", {}):
                continue
            assert not any(isinstance(a, ast.Starred) for a in call.args), (fn, call.lineno)
            kwargs = {}
            for k in call.keywords:
                if k.arg is not None:
                    kwargs[k.arg] = object()
                    continue
                assert isinstance(k.value, ast.Name) and func is not None, (fn, call.lineno)
                keys = _kw_keys(func, k.value.id)
                assert keys is not None, f"{fn}:{call.lineno}: **{k.value.id} not literal"
                kwargs.update(dict.fromkeys(keys, object()))
            for target in filter(None, (name, fallbacks.get(name))):
                try:
                    manifest.signature(target, data).bind(
                        *[object()] * len(call.args), **kwargs)
                except TypeError as e:
                    problems.append(f"jax_mla/backends/aiter/{fn}:{call.lineno}: {target}: {e}")
                checked += 1
    assert checked >= 10, checked
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Mismatches are reported


def _fake(sig):
    def f(*args, **kwargs):
        raise AssertionError("not called")

    f.__signature__ = sig
    return f


def _altered(name, change):
    sig = manifest.signature(name)
    params = list(sig.parameters.values())
    return _fake(sig.replace(parameters=change(params)))


def _swap(i, j):
    def change(ps):
        ps = list(ps)
        ps[i], ps[j] = ps[j], ps[i]
        return ps

    return change


ALTERATIONS = [
    ("order", "aiter.get_mla_metadata_v1", _swap(7, 8),
     r"aiter\.get_mla_metadata_v1: parameter names/order differ \(order differs from position "
     r"7: pinned 'work_info_set', found 'work_indptr'\)"),
    ("rename", "aiter.mla_reduce_v1",
     lambda ps: [p.replace(name="final_out") if p.name == "final_output" else p for p in ps],
     r"aiter\.mla_reduce_v1: parameter names/order differ \(missing final_output; unexpected "
     r"final_out\)"),
    ("dropped", "aiter.mla.mla_decode_fwd", lambda ps: [p for p in ps if p.name != "return_lse"],
     r"aiter\.mla\.mla_decode_fwd: parameter names/order differ \(missing return_lse\)"),
    ("default", "aiter.ops.triton.gluon.mla_gluon.mla_gluon",
     lambda ps: [p.replace(default=576) if p.name == "kv_pe_offset" else p for p in ps],
     r"aiter\.ops\.triton\.gluon\.mla_gluon\.mla_gluon: parameter 'kv_pe_offset' default "
     r"differs: pinned 512, found 576"),
    ("no-default", "aiter.get_ps_metadata_info_v1",
     lambda ps: [p.replace(default=inspect.Parameter.empty) if p.name == "qlen_granularity"
                 else p for p in ps],
     r"aiter\.get_ps_metadata_info_v1: parameter 'qlen_granularity' default differs: pinned "
     r"256, found no default"),
    ("kind", "aiter.flash_attn_varlen_func",
     lambda ps: ps[:-1] + [ps[-1].replace(kind=inspect.Parameter.KEYWORD_ONLY)],
     r"aiter\.flash_attn_varlen_func: parameter 'sink_ptr' kind differs: pinned "
     r"POSITIONAL_OR_KEYWORD, found KEYWORD_ONLY"),
]


def _set(aiter, dotted, value, monkeypatch):
    *mod, attr = dotted.split(".")
    obj = aiter
    for part in mod[1:]:
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(
            f"{obj.__name__}.{part}")
    if value is None:
        monkeypatch.delattr(obj, attr)
    else:
        monkeypatch.setattr(obj, attr, value)


@pytest.mark.parametrize("case", ALTERATIONS, ids=lambda c: c[0])
def test_an_altered_signature_is_reported(monkeypatch, case):
    _, name, change, message = case
    with standin() as aiter:
        # The pinned signature itself, on a stand-in function, is clean.
        _set(aiter, name, _fake(manifest.signature(name)), monkeypatch)
        assert manifest.check_module(aiter) == []
        _set(aiter, name, _altered(name, change), monkeypatch)
        problems = manifest.check_module(aiter)
        monkeypatch.undo()
    assert len(problems) == 1, problems
    assert re.search(message, problems[0]), problems[0]


def test_a_missing_function_or_attribute_is_reported(monkeypatch):
    with standin() as aiter:
        _set(aiter, "aiter.mla_reduce_v1", None, monkeypatch)
        _set(aiter, "aiter.dtypes.fp8", None, monkeypatch)
        problems = manifest.check_module(aiter)
        monkeypatch.undo()
    assert problems == ["aiter.mla_reduce_v1: missing (aiter has no attribute 'mla_reduce_v1')",
                        "aiter.dtypes.fp8: missing (aiter.dtypes has no attribute 'fp8')"]


def test_a_present_fallback_is_checked(monkeypatch):
    name = "aiter.ops.triton.gluon.mla_decode_gluon.mla_decode_gluon"
    with standin() as aiter:
        legacy = types.ModuleType("aiter.ops.triton.gluon.mla_decode_gluon")
        monkeypatch.setitem(sys.modules, legacy.__name__, legacy)
        legacy.mla_decode_gluon = _fake(manifest.signature(name))
        assert manifest.check_module(aiter) == []
        legacy.mla_decode_gluon = _altered(name, lambda ps: ps[:-1])
        problems = manifest.check_module(aiter)
        monkeypatch.undo()
    assert problems == [f"{name}: parameter names/order differ (missing return_lse): pinned "
                        f"({', '.join(manifest.signature(name).parameters)}), found "
                        f"({', '.join(list(manifest.signature(name).parameters)[:-1])})"]


def test_a_compiled_op_stub_is_read_from_its_def(monkeypatch):
    # compile_ops: functools.wraps around the stub, whose __signature__ AITER overwrites from the
    # compiled op's docstring on first call. The stub's own def is what we pin.
    import functools

    def mla_reduce_v1(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                      reduce_partial_map, max_seqlen_q, num_kv_splits, final_output,
                      final_lse=None): ...

    @functools.wraps(mla_reduce_v1)
    def wrapper(*args, custom_build_args=None, **kwargs): ...

    mla_reduce_v1.__signature__ = inspect.signature(lambda a, b, c=1: None)
    with standin() as aiter:
        monkeypatch.setattr(aiter, "mla_reduce_v1", wrapper)
        problems = manifest.check_module(aiter)
        monkeypatch.undo()
    assert problems == []


def test_an_opaque_wrapper_is_read_from_its_source(tmp_path):
    # AITER's ctypes ops are `(*args, **kwargs)` wrappers at run time: read the def instead.
    name = "aiter.mla_prefill_ps_asm_fwd"
    entry = manifest.load_manifest()["functions"][name]
    only = {"functions": {name: entry}}
    path = tmp_path / entry["file"]
    path.parent.mkdir(parents=True)
    (tmp_path / "aiter" / "__init__.py").write_text("")
    root = types.ModuleType("aiter")
    root.__file__ = str(tmp_path / "aiter" / "__init__.py")
    root.mla_prefill_ps_asm_fwd = lambda *args, **kwargs: None
    params = str(manifest.signature(name))[1:-1]
    path.write_text(f"@decorator(MD_NAME)\ndef mla_prefill_ps_asm_fwd({params}) -> None: ...\n")
    assert manifest.check_module(root, only) == []
    path.write_text(f"def mla_prefill_ps_asm_fwd({params.replace('v_scale=None', 'v_scale=1')})"
                    f": ...\n")
    assert manifest.check_module(root, only) == [
        f"{name}: parameter 'v_scale' default differs: pinned None, found 1"]
    path.unlink()
    assert manifest.check_module(root, only) == [
        f"{name}: signature not introspectable (an opaque wrapper) and no def "
        f"mla_prefill_ps_asm_fwd in {entry['file']}"]


def test_check_installed_is_none_without_aiter(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "aiter" else real(n, *a))
    assert manifest.check_installed() is None


# ---------------------------------------------------------------------------------------------
# The installed AITER (ROCm hosts)


def _real_aiter_spec():
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    if os.path.abspath(spec.origin).startswith(os.path.abspath(STANDIN_DIR) + os.sep):
        return None  # our stand-in, not AITER
    return spec


@pytest.mark.skipif(_real_aiter_spec() is None, reason="needs a ROCm host with AITER")
def test_installed_aiter_matches_the_manifest():
    problems = manifest.check_installed()
    assert problems is not None
    data = manifest.load_manifest()
    assert problems == [], (
        f"the installed AITER ({_real_aiter_spec().origin}) differs from ROCm/aiter "
        f"{data['aiter_commit']}, the API jax_mla is written against:\n" + "\n".join(problems))
