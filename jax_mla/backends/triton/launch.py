"""One way to launch a ``@triton.jit`` (or ``@gluon.jit``) kernel inside ``jax.jit``, everywhere.

- CUDA / ROCm: ``jax_triton.triton_call``, i.e. jaxlib's native ``triton_kernel_call`` custom call
  (no Python on the hot path). jax-triton cannot even be imported on a CPU-only jaxlib, so it is
  imported here lazily, only when lowering for a GPU.
- CPU: the *same* kernel source runs under Triton's interpreter through
  ``jax.experimental.buffer_callback`` and ``torch.from_dlpack`` (slow; for CI and small shapes).
  The interpreter is switched on by ``TRITON_INTERPRET=1`` before triton is first imported.

Kernel arguments are the inputs, then the outputs (jax-triton's convention). Python scalars are
baked in at compile time: pass values that change from step to step as arrays.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading

from jax_mla import env
from jax_mla.backends.triton import compiler
from jax_mla.problem import GPU_PLATFORMS

# Triton's interpreter patches module globals while it runs a kernel, and a first ``import torch``
# is not thread safe either: on a multi-device CPU mesh (DCP tests) XLA runs one callback per
# device thread at once, and either race aborts the process. Interpreted launches take turns.
_INTERPRET_LOCK = threading.Lock()


@functools.cache
def triton_importable(platform: str) -> bool:
    """Whether Triton kernels can run for ``platform`` in this process."""
    if importlib.util.find_spec("triton") is None:
        return False
    if platform in GPU_PLATFORMS:
        return importlib.util.find_spec("jax_triton") is not None
    if platform != "cpu":
        return False
    # On CPU only the interpreter runs kernels; it must be chosen before triton is imported.
    if "triton" not in sys.modules:
        env.choose_interpreter()
    return env.interpreter_enabled() and importlib.util.find_spec("torch") is not None


def unavailable_reason(platform: str) -> str | None:
    """What is missing for Triton kernels on ``platform`` (None: nothing)."""
    if triton_importable(platform):
        return None
    if platform in GPU_PLATFORMS:
        return ("backend='triton' needs triton and jax-triton on a GPU host "
                "(pip install 'jax_mla[cuda]')")
    if platform == "cpu":
        return ("backend='triton' on a CPU runs Triton's interpreter: it needs triton and torch "
                "(pip install 'jax_mla[test]') and TRITON_INTERPRET=1 before triton is imported")
    return f"backend='triton' does not run on platform {platform!r}"


def triton_call(kernel, *args, grid, out_shapes, platform, input_output_aliases=None,
                num_warps=4, num_stages=2, **constexprs):
    """Run ``kernel[grid](*args, *outs, **constexprs)``; returns the output arrays (a tuple).

    ``input_output_aliases`` maps the index of an array argument (scalars not counted) to the
    output that reuses its buffer; the kernel still gets both pointers (jax-triton's rule).
    """
    out_shapes = tuple(out_shapes)
    aliases = dict(input_output_aliases or {})
    if platform in GPU_PLATFORMS:
        import jax_triton as jt

        compiler.install()  # WG_SPLIT and @gluon.jit kernels: see compiler.py

        outs = jt.triton_call(*args, kernel=kernel, out_shape=out_shapes, grid=grid,
                              input_output_aliases=aliases, num_warps=num_warps,
                              num_stages=num_stages, **constexprs)
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    return _interpret_call(kernel, args, grid, out_shapes, aliases, constexprs)


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _interpret_call(kernel, args, grid, out_shapes, aliases, constexprs):
    import torch  # noqa: F401  (here, at trace time on one thread; not first inside a callback)
    from jax.experimental import buffer_callback

    arrays = [a for a in args if _is_array(a)]
    scalars = {i: a for i, a in enumerate(args) if not _is_array(a)}
    aliased_outputs = set(aliases.values())

    def callback(ctx, outs, *ins):
        with _INTERPRET_LOCK:
            _launch(outs, ins)

    def _launch(outs, ins):
        it = iter(_to_torch(b) for b in ins)
        call_args = [scalars[i] if i in scalars else next(it) for i in range(len(args))]
        out_t = [_to_torch(o) for o in outs]
        if env.poison_outputs():
            for j, o in enumerate(out_t):
                if j not in aliased_outputs:
                    o.fill_(float("nan") if o.is_floating_point() else -1)
        kernel[grid](*call_args, *out_t, **constexprs)

    fn = buffer_callback.buffer_callback(callback, out_shapes, input_output_aliases=aliases)
    outs = fn(*arrays)
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def ptxas_spills(ptx: str, arch: str = "sm_90a") -> int | None:
    """Bytes of register spill stores and loads ptxas reports for ``ptx`` (no GPU needed).

    Uses the ptxas that ships inside triton's NVIDIA backend, the newest one that accepts this PTX
    (triton 3.9 ships two); ``None`` when none of them can.
    """
    import glob
    import subprocess
    import tempfile

    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for exe in sorted(glob.glob(os.path.join(bindir, "ptxas*")))[::-1]:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            res = subprocess.run([exe, "-v", "--gpu-name", arch, path, "-o", path + ".cubin"],
                                 capture_output=True, text=True)
        if res.returncode == 0:
            return sum(int(w) for line in res.stderr.splitlines() if "spill" in line
                       for w, nxt in zip(line.split(), line.split()[1:])
                       if nxt == "bytes" and w.isdigit())
    return None


def _to_torch(buf):
    import torch

    return torch.from_dlpack(buf)
