"""The AITER API jax_mla calls, pinned: ``manifest.json`` and the checks against it.

``manifest.json`` (shipped with the package) records every AITER function and attribute that
``jax_mla.backends.aiter`` calls, as defined in ROCm/aiter at one pinned commit: the dotted name
we call it by, the defining file, and each parameter's name, order, kind and default (the
``repr`` of the default value; ``default_expr`` keeps the source expression where it is not a
literal). AITER's compiled ops (``@compile_ops`` stubs such as ``mla_reduce_v1``) are recorded
from their Python stubs, which is what ``aiter.<op>`` accepts. AITER's Triton kernels that jax_mla
launches itself (``triton_kernels``) are recorded by their JIT parameter list: names, order,
``tl.constexpr`` or scalar-type annotations and defaults (:func:`jit_param_facts`,
:func:`check_triton_kernel`), with the facts of how AITER launches them.

:func:`check_module` compares a module tree (the test stand-in, or a real ``aiter``) with it;
:func:`check_installed` does so for the ``aiter`` importable now. Nothing here imports torch or
aiter at ``jax_mla`` import time.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import os
import types

MANIFEST_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "manifest.json")

_OPAQUE_KINDS = {"VAR_POSITIONAL", "VAR_KEYWORD"}


@functools.cache
def _manifest_text() -> str:
    with open(MANIFEST_PATH, encoding="utf-8") as f:
        return f.read()


def load_manifest() -> dict:
    """The parsed ``manifest.json`` (a fresh dict each call)."""
    return json.loads(_manifest_text())


def function_names(manifest: dict | None = None) -> list[str]:
    """Dotted names (``aiter.mla.mla_decode_fwd``, ...) of the pinned functions."""
    return list((manifest or load_manifest())["functions"])


# ---------------------------------------------------------------------------------------------
# Signature facts: the same shape as a manifest entry's ``params``


def signature_facts(fn) -> list[dict] | None:
    """``[{name, kind, default?}]`` of ``fn``'s live signature; None when it says nothing.

    None when ``inspect.signature`` fails, or the signature is only ``(*args, **kwargs)`` (an
    opaque wrapper such as AITER's ``torch_compile_guard`` around a ctypes op).
    """
    try:
        sig = _live_signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if all(p.kind.name in _OPAQUE_KINDS for p in params):
        return None
    out = []
    for p in params:
        fact = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            fact["default"] = repr(p.default)
        out.append(fact)
    return out


def _live_signature(fn) -> inspect.Signature:
    inner = inspect.unwrap(fn) if hasattr(fn, "__wrapped__") else fn
    if inner is not fn and isinstance(inner, types.FunctionType) and "__signature__" in vars(
            inner):
        # AITER's compile_ops wraps a stub (functools.wraps) and, on the op's first call,
        # overwrites the stub's __signature__ with one parsed from the compiled op's docstring:
        # read the stub's own def instead.
        bare = types.FunctionType(inner.__code__, inner.__globals__, inner.__name__,
                                  inner.__defaults__, inner.__closure__)
        bare.__kwdefaults__ = inner.__kwdefaults__
        return inspect.signature(bare)
    return inspect.signature(fn)


def _ast_default(node) -> dict:
    try:
        return {"default": repr(ast.literal_eval(node))}
    except ValueError:
        return {"default_expr": ast.unparse(node)}


def source_facts(path: str, defname: str) -> list[dict] | None:
    """``[{name, kind, default? | default_expr?}]`` of the top-level ``def defname`` in the file
    at ``path`` (read as text, never imported); None when there is no such def."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    defs = [n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == defname]
    if not defs:
        return None
    a = defs[-1].args  # the last one wins at import, as Python binds it
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = []
    for i, (arg, d) in enumerate(zip(pos, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append({"name": arg.arg, "kind": kind, **(_ast_default(d) if d is not None else {})})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL"})
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "KEYWORD_ONLY",
                    **(_ast_default(d) if d is not None else {})})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD"})
    return out


def _fmt_default(fact: dict) -> str:
    if "default" in fact:
        return fact["default"]
    if "default_expr" in fact:
        return fact["default_expr"]
    return "no default"


def compare_params(name: str, pinned: list[dict], found: list[dict]) -> list[str]:
    """Mismatches between the pinned ``params`` of ``name`` and ``found`` (one message each)."""
    problems = []
    want = [p["name"] for p in pinned]
    got = [p["name"] for p in found]
    if want != got:
        missing = [n for n in want if n not in got]
        extra = [n for n in got if n not in want]
        detail = []
        if missing:
            detail.append(f"missing {', '.join(missing)}")
        if extra:
            detail.append(f"unexpected {', '.join(extra)}")
        if not missing and not extra:
            i = next(i for i, (w, g) in enumerate(zip(want, got)) if w != g)
            detail.append(f"order differs from position {i}: pinned {want[i]!r}, found {got[i]!r}")
        problems.append(f"{name}: parameter names/order differ ({'; '.join(detail)}): pinned "
                        f"({', '.join(want)}), found ({', '.join(got)})")
    by_name = {p["name"]: p for p in found}
    for p in pinned:
        q = by_name.get(p["name"])
        if q is None:
            continue
        if p["kind"] != q["kind"]:
            problems.append(f"{name}: parameter {p['name']!r} kind differs: pinned {p['kind']}, "
                            f"found {q['kind']}")
        if "default_expr" in q and "default" not in q:
            same = q["default_expr"] == p.get("default_expr")
        else:
            same = q.get("default") == p.get("default")
        if not same:
            problems.append(f"{name}: parameter {p['name']!r} default differs: pinned "
                            f"{_fmt_default(p)}, found {_fmt_default(q)}")
    return problems


# ---------------------------------------------------------------------------------------------
# Triton kernels: the JIT parameter list


def _annotation_name(a) -> str:
    """``constexpr``, a Triton scalar type's name (``int64``), or "" (none); without importing
    triton: ``tl.constexpr`` is a class of that name, ``tl.int64`` a ``dtype`` with a name."""
    if a is inspect.Parameter.empty or a is None:
        return ""
    if isinstance(a, str):
        return a.rsplit(".", 1)[-1]
    if isinstance(a, type):
        return a.__name__
    name = getattr(a, "name", None)
    return name if isinstance(name, str) else repr(a)


def jit_param_facts(kernel) -> list[dict] | None:
    """``[{name, kind, annotation?, default?}]`` of a ``@triton.jit`` function (a compiling
    ``JITFunction`` or the interpreter's ``InterpretedFunction``: both keep the Python function
    as ``.fn``); None when ``kernel`` is not one."""
    fn = getattr(kernel, "fn", None)
    if not callable(fn) or not hasattr(kernel, "__getitem__"):
        return None
    facts = signature_facts(fn)
    if facts is None:
        return None
    params = inspect.signature(fn).parameters
    for fact in facts:
        ann = _annotation_name(params[fact["name"]].annotation)
        if ann:
            fact["annotation"] = ann
    return facts


def check_triton_kernel(name: str, kernel, manifest: dict | None = None) -> list[str]:
    """Mismatches between the pinned JIT parameter list of ``name`` (a ``triton_kernels``
    entry) and ``kernel``'s: names and order, kinds, defaults, and which parameters are
    ``tl.constexpr`` or typed scalars. ``[]`` when they agree."""
    entry = (manifest or load_manifest())["triton_kernels"][name]
    found = jit_param_facts(kernel)
    if found is None:
        return [f"{name}: not a Triton JIT function ({type(kernel).__name__})"]
    problems = compare_params(name, entry["params"], found)
    by_name = {p["name"]: p for p in found}
    for p in entry["params"]:
        q = by_name.get(p["name"])
        if q is not None and p.get("annotation", "") != q.get("annotation", ""):
            problems.append(f"{name}: parameter {p['name']!r} annotation differs: pinned "
                            f"{p.get('annotation') or 'none'}, found "
                            f"{q.get('annotation') or 'none'}")
    return problems


# ---------------------------------------------------------------------------------------------
# Checking a module tree


_MISSING = object()


def _resolve(root, dotted: str):
    """The object ``dotted`` (``aiter.x.y``) names under ``root`` (the module standing for
    ``aiter``), importing submodules as Python's ``import`` would; ``(obj, None)`` or
    ``(_MISSING, why)``."""
    obj = root
    parts = dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if inspect.ismodule(obj):
            sub = f"{obj.__name__}.{part}"
            try:
                obj = importlib.import_module(sub)
                continue
            except ModuleNotFoundError as e:
                if e.name is not None and e.name != sub and not sub.startswith(e.name + "."):
                    return _MISSING, f"importing {sub} failed: {e}"
            except Exception as e:  # a real import error of an existing module
                return _MISSING, f"importing {sub} failed: {type(e).__name__}: {e}"
        where = ".".join(["aiter", *parts[:i]])
        return _MISSING, f"{where} has no attribute {part!r}"
    return obj, None


def _source_root(root) -> str | None:
    f = getattr(root, "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(f))) if f else None


def check_module(root_module, manifest: dict | None = None) -> list[str]:
    """Mismatches between the module tree under ``root_module`` (imported as ``aiter``) and the
    manifest: a missing function, Triton kernel or attribute, parameter names/order, kinds,
    defaults (or, for a Triton kernel, constexpr/type annotations) that differ. Each message
    names the function and the difference; ``[]`` when all agree.

    A live signature that is only ``(*args, **kwargs)`` (AITER wraps its ctypes ops so) is read
    from the ``def`` in the module's source file instead. Fallback entries (names the bridge
    tries only when the pinned one is absent) are checked only where present.
    """
    manifest = manifest or load_manifest()
    problems = []
    src_root = _source_root(root_module)

    def check(name, entry, optional=False):
        obj, why = _resolve(root_module, name)
        if obj is _MISSING:
            if not optional:
                problems.append(f"{name}: missing ({why})")
            return
        if not callable(obj):
            problems.append(f"{name}: not callable ({type(obj).__name__})")
            return
        found = signature_facts(obj)
        if found is None:
            defname = name.rsplit(".", 1)[1]
            path = os.path.join(src_root, entry["file"]) if src_root else None
            found = source_facts(path, defname) if path else None
            if found is None:
                problems.append(f"{name}: signature not introspectable (an opaque wrapper) and "
                                f"no def {defname} in {entry['file']}")
                return
        problems.extend(compare_params(name, entry["params"], found))

    for name, entry in manifest["functions"].items():
        check(name, entry)
    for name in manifest.get("triton_kernels", {}):
        obj, why = _resolve(root_module, name)
        if obj is _MISSING:
            problems.append(f"{name}: missing ({why})")
        else:
            problems.extend(check_triton_kernel(name, obj, manifest))
    for name in manifest.get("attributes", {}):
        obj, why = _resolve(root_module, name)
        if obj is _MISSING:
            problems.append(f"{name}: missing ({why})")
    for name, entry in manifest.get("fallbacks", {}).items():
        check(name, entry, optional=True)
    return problems


def check_installed() -> list[str] | None:
    """:func:`check_module` of the ``aiter`` importable now; None when there is none.

    Imports aiter (and so torch) only here, when called. An ``aiter`` that is found but fails
    to import is reported as a mismatch, not as None.
    """
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    try:
        aiter = importlib.import_module("aiter")
    except Exception as e:
        return [f"aiter: found at {spec.origin} but `import aiter` failed: "
                f"{type(e).__name__}: {e}"]
    return check_module(aiter)


def signature(name: str, manifest: dict | None = None) -> inspect.Signature:
    """An :class:`inspect.Signature` of the pinned ``name`` (a function or fallback entry), with
    each default the value its ``repr`` spells: for binding a call's arguments to the pinned
    parameters, or standing in for the function in a check."""
    manifest = manifest or load_manifest()
    entry = {**manifest.get("fallbacks", {}), **manifest["functions"]}[name]
    params = []
    for p in entry["params"]:
        default = inspect.Parameter.empty
        if "default" in p:
            try:
                default = ast.literal_eval(p["default"])
            except ValueError:
                default = p["default"]
        params.append(inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]),
                                        default=default))
    return inspect.Signature(params)
