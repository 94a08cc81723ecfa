"""Source rules for the kernels that CPU CI's triton cannot check by compiling.

CI compiles with a newer triton than the GPU image's (3.6). Triton 3.6 fails to compile a
``@triton.jit`` helper that is called without one of its defaulted parameters ("'str' object has
no attribute 'type'", seen on the H200 on 2026-12-03), and 3.9 accepts it. Launched kernels
(``mla_*_kernel``) may have defaults: jax-triton passes every constexpr by name.
"""

import ast
import pathlib

KERNELS = pathlib.Path(__file__).parents[1] / "jax_mla" / "kernels"


def _jit_functions():
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).endswith(".jit") for d in node.decorator_list):
                yield path, node


def test_jit_helpers_have_no_default_arguments():
    found = list(_jit_functions())
    assert len(found) > 20  # the walk sees the Triton and Gluon kernels
    bad = [f"{p.name}:{f.lineno} {f.name}" for p, f in found
           if not (f.name.startswith("mla_") and f.name.endswith("_kernel"))
           and (f.args.defaults or any(d is not None for d in f.args.kw_defaults))]
    assert not bad, f"jit helpers with default arguments (triton 3.6 cannot compile them): {bad}"
