"""One way to launch a ``@triton.jit`` (or ``@gluon.jit``) kernel inside ``jax.jit``, everywhere.

Three launchers (:data:`LAUNCHERS`; the plan's, or :func:`resolve_launcher`'s choice):

- ``ffi`` (CUDA / ROCm): jax_mla's own typed XLA FFI handler (``ffi/triton_launch.cc``) launches
  the kernel compiled ahead of time for the plan's target (``ffi_launch.py``). Command-buffer
  compatible; no jax-triton.
- ``jax_triton`` (CUDA / ROCm): ``jax_triton.triton_call``, jaxlib's legacy ``triton_kernel_call``
  custom call. jax-triton cannot even be imported on a CPU-only jaxlib, so it is imported here
  lazily, only when lowering for a GPU.
- ``interpret`` (CPU): the *same* kernel source runs under Triton's interpreter through
  ``jax.experimental.buffer_callback`` and ``torch.from_dlpack`` (slow; for CI and small shapes).
  The interpreter is switched on by ``TRITON_INTERPRET=1`` before triton is first imported.

Kernel arguments are the inputs, then the outputs (jax-triton's convention). Every argument is an
array; compile-time values go as constexpr keywords (a new value is a new compile).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading

from jax_mla import env
from jax_mla.backends.triton import compiler, ffi_launch
from jax_mla.problem import GPU_PLATFORMS, Target, as_target

LAUNCHERS = ("auto", "ffi", "ffi_record", "jax_triton")

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
        return _jax_triton_installed() or ffi_launch.unavailable_reason() is None
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
        return ("backend='triton' on a GPU needs triton and jax_mla's FFI launcher library "
                f"(pip install 'jax_mla[cuda]'): {ffi_launch.unavailable_reason()}")
    if platform == "cpu":
        return ("backend='triton' on a CPU runs Triton's interpreter: it needs triton and torch "
                "(pip install 'jax_mla[test]') and TRITON_INTERPRET=1 before triton is imported")
    return f"backend='triton' does not run on platform {platform!r}"


def _jax_triton_installed() -> bool:
    return importlib.util.find_spec("jax_triton") is not None


def resolve_launcher(target: Target, choice: str | None = None) -> str:
    """The launcher for ``target``: ``interpret`` on CPU; on GPUs ``choice`` (default: the
    ``JAX_MLA_TRITON_LAUNCHER`` variable, else ``auto``), where ``auto`` is the FFI launcher.

    ``auto`` falls back to jax-triton only when the FFI library is missing and jax-triton is
    installed, and says so once (a warning naming the library's problem); with neither, it stays
    ``ffi``, whose first launch raises an error saying what to install.
    """
    if not target.gpu:
        return "interpret"
    choice = choice or env.read_choice("JAX_MLA_TRITON_LAUNCHER", LAUNCHERS, "auto")
    if choice not in LAUNCHERS:
        raise ValueError(f"launcher={choice!r} must be one of {LAUNCHERS}")
    if choice == "auto":
        missing = ffi_launch.unavailable_reason()
        if missing is not None and _jax_triton_installed():
            _warn_fallback(missing)
            return "jax_triton"
        return "ffi"
    return choice


@functools.cache
def _warn_fallback(missing: str) -> None:
    import warnings

    warnings.warn(f"jax_mla: the FFI launcher is unavailable ({missing}); Triton kernels are "
                  "launched through jax-triton, which XLA cannot capture in command buffers. "
                  "Reinstall jax_mla with a C++ compiler (docs/launcher.md, Building), or set "
                  "JAX_MLA_TRITON_LAUNCHER=jax_triton to choose it.", stacklevel=3)


def triton_call(kernel, *args, grid, out_shapes, target, launcher=None,
                input_output_aliases=None, num_warps=4, num_stages=2, compile_options=None,
                **constexprs):
    """Run ``kernel[grid](*args, *outs, **constexprs)``; returns the output arrays (a tuple).

    ``target``: a :class:`~jax_mla.problem.Target` or a platform name; ``launcher``: one of
    :data:`LAUNCHERS` (default :func:`resolve_launcher`'s). ``input_output_aliases`` maps the
    index of an argument to the output that reuses its buffer; the kernel still gets both
    pointers (jax-triton's rule). ``compile_options``: further options of Triton's compile for
    the target's backend (e.g. ``{"waves_per_eu": 1}`` on ROCm), used by the ahead-of-time
    compile of the ``ffi`` launcher; options the backend does not have are an error there. The
    interpreter and jax-triton take none (they run or compile without them).
    """
    target = as_target(target)
    launcher = resolve_launcher(target, launcher)
    out_shapes = tuple(out_shapes)
    aliases = dict(input_output_aliases or {})
    if launcher in ("ffi", "ffi_record"):
        return ffi_launch.launch(kernel, args, grid=grid, out_shapes=out_shapes, target=target,
                                 input_output_aliases=aliases, num_warps=num_warps,
                                 num_stages=num_stages, compile_options=compile_options,
                                 record=launcher == "ffi_record", **constexprs)
    if launcher == "jax_triton":
        if not _jax_triton_installed():
            raise RuntimeError("launcher='jax_triton' needs jax-triton (pip install "
                               "'jax_mla[cuda]'); launcher='ffi' needs none")
        jt = _import_jax_triton()
        compiler.install()  # WG_SPLIT and @gluon.jit kernels: see compiler.py

        outs = jt.triton_call(*args, kernel=kernel, out_shape=out_shapes, grid=grid,
                              input_output_aliases=aliases, num_warps=num_warps,
                              num_stages=num_stages, **constexprs)
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    return _interpret_call(kernel, args, grid, out_shapes, aliases, constexprs)


def triton_sequence(steps, arrays, *, out_shapes, target, launcher=None) -> tuple:
    """Several kernels in order, as one custom call where the launcher can; the results
    (``out_shapes``), a tuple.

    ``steps``: :class:`~jax_mla.backends.triton.ffi_launch.SequenceStep` s. A step's
    ``inputs`` index the buffers (``arrays``, then the results: ``len(arrays) + j`` is result
    ``j``, which an earlier step must have written); its ``outputs`` are the results it writes.
    The kernel's parameters are its inputs, then its outputs; a result among both is rewritten
    in place (the kernels' convention for an aliased output: it appears twice). With the
    ``ffi`` launcher on a GPU the steps are one custom call (``ffi_launch.launch_sequence``);
    with the others (the interpreter, jax-triton, the record target) they are
    :func:`triton_call` s in turn with the same parameters, so every launcher computes the same
    thing."""
    target = as_target(target)
    launcher = resolve_launcher(target, launcher)
    arrays, out_shapes = tuple(arrays), tuple(out_shapes)
    if launcher == "ffi":
        return ffi_launch.launch_sequence(steps, arrays, out_shapes=out_shapes, target=target)
    return sequence_in_turn(steps, arrays, out_shapes, triton_call, target=target,
                            launcher=launcher)


def sequence_in_turn(steps, arrays, out_shapes, call, **kw) -> tuple:
    """The steps of :func:`triton_sequence` as calls of ``call`` (``triton_call``'s signature,
    ``kw`` added) in turn: each step's inputs from the operands or the results so far, its
    outputs new, a result it also reads aliased to its input. The results, a tuple."""
    n = len(arrays)
    ffi_launch.check_sequence(steps, n, len(out_shapes))
    results: dict[int, object] = {}
    for step in steps:
        aliases = {k: step.outputs.index(i - n) for k, i in enumerate(step.inputs)
                   if i >= n and i - n in step.outputs}
        got = call(step.kernel, *(arrays[i] if i < n else results[i - n] for i in step.inputs),
                   grid=step.grid, out_shapes=[out_shapes[j] for j in step.outputs],
                   input_output_aliases=aliases, num_warps=step.num_warps,
                   num_stages=step.num_stages, compile_options=step.compile_options,
                   **kw, **step.constexprs)
        results.update(zip(step.outputs, got))
    return tuple(results[j] for j in range(len(out_shapes)))


def _import_jax_triton():
    """``jax_triton``, imported without its side effect on the environment: its import sets
    ``TRITON_CACHE_DIR=""``, after which every Triton compile in the process (torch's, AITER's)
    fails with "Could not create or locate cache dir"."""
    if "jax_triton" in sys.modules:
        return sys.modules["jax_triton"]
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if before is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = before
    return jax_triton


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


def ptxas_spills(ptx: str, arch: int = 90) -> int | None:
    """Bytes of register spill stores and loads in ``ptx`` built for CUDA ``arch`` by the
    installed Triton's own cubin step (its ptxas and flags: ``compiler.ptxas_stats``; no GPU
    needed); ``None`` when that step cannot build it."""
    from triton.backends.compiler import GPUTarget

    try:
        return compiler.ptxas_stats(ptx, GPUTarget("cuda", arch, 32))["spills"]
    except Exception:  # noqa: BLE001 - e.g. PTX newer than this Triton's ptxas
        return None


def _to_torch(buf):
    import torch

    return torch.from_dlpack(buf)
