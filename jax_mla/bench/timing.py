"""Stream time of jitted functions, and the machine's ceilings measured in the same run.

*Stream time*: a call is timed as one jitted program that runs it ``n`` times back to back, each
call fed a *data dependency* on the previous call's output: when the output has the shape and
dtype of the first argument it becomes the next call's first argument (a true chain); otherwise
one element of the first array argument is bumped by ``output[0] > 3e38`` (always 0 for real
data, but XLA can neither prove it nor hoist, merge, reorder or overlap the calls). Each output
passes an optimization barrier, so consecutive elementwise calls cannot fuse into one pass. Wall
time / ``n`` is the time of one call in a stream of dependent calls, its launch gaps included,
with the program's single dispatch amortised; ``n`` grows until the program runs for about
``min_ms``. The median of ``reps`` runs is reported. (*GPU time*, the kernels alone, is read
from CUPTI: ``profile.py``.)

Each timed run is dispatched alone and waited for, so the stream time carries the host's work
before the program's first kernel (XLA's dispatch and its command-buffer update) and the final
sync, once per ``n`` calls. *In flight* (``in_flight=True``) the program instead takes the
previous run's output, its first call fed from it as the calls within a run are, and runs are
dispatched back to back with one sync at the end, for about :data:`IN_FLIGHT_MS`: the host
prepares the next run while the GPU runs this one, as in a serving loop (or a CUDA graph
replayed on one stream). Wall time / calls then is the larger of the host's and the GPU's time
a call; the first run's host work and the last sync are not hidden, so it errs slow, never
fast. (On an H100, 2026-12-06, it came within 0-6 % of the stream time at every shape: what a
run's boundary costs is not hidden by queuing runs.)

*Back to back* (``serial=True``): the calls of a run take a copy of the first argument each and
every output is returned, with no dependency between them and no kernel of the timer's own (the
dependency above costs one small kernel a call); they follow each other on the device's stream,
as the calls of a CUDA graph do. With ``in_flight=True`` too, such runs are dispatched back to
back (each on the same inputs; the device's stream orders them) with one sync at the end, as
FlashMLA's graph replays are timed in flight: the host's work for a run hides under the GPU's
work on the run before, and no kernel of the timer's is counted.

The copy probe of :func:`ceilings` multiplies by 1.25 (exact in bf16, so XLA cannot drop it),
and figures above any datasheet are flagged: a broken chain shows there first.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import platform
import statistics
import time

import jax
import jax.numpy as jnp

import jax_mla
from jax_mla.problem import current_platform


def _dependency(out_leaf):
    """A scalar that is 0 for any finite output but that XLA cannot fold."""
    x = out_leaf.reshape(-1)[0]
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float32) > 3e38
    return x > jnp.iinfo(x.dtype).max - 1


def _feed(args, out):
    leaves, tree = jax.tree.flatten(args)
    out_leaves = jax.tree.leaves(out)
    first = leaves[0]
    o0 = out_leaves[0]
    if o0.shape == first.shape and o0.dtype == first.dtype:
        leaves[0] = o0
    else:
        dep = _dependency(o0).astype(first.dtype)
        leaves[0] = first.at[(0,) * first.ndim].add(dep)
    return jax.tree.unflatten(tree, leaves)


def chained(fn, n, donated: bool = False, fed: bool = False, serial: bool = False):
    """``fn`` called ``n`` times, each call fed the previous one's output (module docstring),
    as one jitted program. ``donated``: the program takes one more first argument, a pytree
    shaped like the output, donated and ignored, so that the output is written into the
    buffers passed in (:func:`device_time` passes the last run's output back). ``fed``: the
    program takes the previous run's output first and feeds its first call from it, so that
    runs dispatched back to back are one chain. ``serial``: no dependency and no feeding
    kernel; the program takes a tuple of ``n`` first arguments, one a call (as each layer of a
    model has its own query), and returns every call's output, so that XLA can neither merge
    nor drop a call; they run one after another on the device's stream, as a CUDA graph of
    ``n`` calls replays."""
    if donated + fed + serial > 1:
        raise ValueError("chained: donated, fed and serial are exclusive")
    if serial:
        return jax.jit(lambda firsts, *rest: tuple(fn(first, *rest) for first in firsts))

    def many(*args):
        # The barrier materialises each call's output: XLA cannot fuse consecutive calls
        # (a chain of elementwise ops would otherwise become one pass over memory).
        out = jax.lax.optimization_barrier(fn(*args))
        for _ in range(n - 1):
            args = _feed(args, out)
            out = jax.lax.optimization_barrier(fn(*args))
        return out

    if fed:
        return jax.jit(lambda prev, *args: many(*_feed(args, prev)))
    if not donated:
        return jax.jit(many)
    # keep_unused: jax would otherwise drop the unread sink, and its donation with it.
    return jax.jit(lambda sink, *args: many(*args), donate_argnums=0, keep_unused=True)


def _wall(f, args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


# Shortest chained program, in ms: the program's own dispatch and final sync (~50-100 us on a GPU)
# are spread over its calls, so short programs read slow. The bench uses 20 (``--min-ms``).
MIN_MS = 3.0
# Repetitions (median), and the calls of the one-call estimate; a smoke run (``--quick``, where
# a call in Triton's interpreter costs seconds) sets both to 1 through :func:`smoke`.
REPS = 5
EST_CALLS = 3
# Wall time of one in-flight timing, in ms: the first run's host work and the final sync (about
# 1.5 ms with XLA's log on, on an H100) are spread over it.
IN_FLIGHT_MS = 100.0


def smoke() -> None:
    """Time as little as can still be called a timing: one repetition, the shortest chain."""
    global REPS, EST_CALLS, MIN_MS, IN_FLIGHT_MS
    REPS, EST_CALLS, MIN_MS, IN_FLIGHT_MS = 1, 1, 0.0, 0.0


def device_time(fn, *args, min_ms: float | None = None, reps: int | None = None,
                max_n: int = 128, donated: bool = False, in_flight: bool = False,
                serial: bool = False) -> float:
    """Median seconds per call of ``fn(*args)`` (see the module docstring).

    ``donated``: each run's output is written into the buffers of the run before (donated),
    as a CUDA graph replayed on fixed buffers writes into the same ones. Otherwise every run
    gets fresh output buffers, and XLA updates a command buffer whose buffers moved before it
    replays it (on an H100, 2026-12-06, the two gave the same stream times within noise).
    ``in_flight``: runs dispatched back to back, each fed the one before, one sync at the end
    (module docstring). ``serial``: the calls of a run back to back with no dependency and no
    feeding kernel, each on its own copy of the first argument (``chained(..., serial=True)``):
    the stream time without the timer's own kernel a call, as FlashMLA's graph is timed. Both
    ``serial`` and ``in_flight``: those runs dispatched back to back, one sync at the end."""
    if donated + in_flight > 1 or donated + serial > 1:
        raise ValueError("device_time: donated is exclusive with in_flight and serial")
    min_ms = MIN_MS if min_ms is None else min_ms
    reps = REPS if reps is None else reps
    one = jax.jit(fn)
    jax.block_until_ready(one(*args))
    est = min(_wall(one, args) for _ in range(EST_CALLS))
    n = int(max(2, min(max_n, (min_ms * 1e-3) // max(est, 1e-6))))
    if serial:
        inputs = serial_inputs(args, n)
        many = chained(fn, n, serial=True)
        if in_flight:  # each run on the same inputs, the last one's output unused
            return _in_flight(lambda _last, *a: many(*a), None, inputs, reps) / n
        jax.block_until_ready(many(*inputs))
        return statistics.median(_wall(many, inputs) for _ in range(reps)) / n
    if in_flight:
        return _in_flight(chained(fn, n, fed=True), one(*args), args, reps) / n
    if not donated:
        many = chained(fn, n)
        jax.block_until_ready(many(*args))
        return statistics.median(_wall(many, args) for _ in range(reps)) / n
    many = chained(fn, n, donated=True)
    sink = jax.block_until_ready(many(one(*args), *args))
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sink = jax.block_until_ready(many(sink, *args))
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) / n


def in_flight_runs(run_s: float) -> int:
    """Runs of ``run_s`` seconds each that fill :data:`IN_FLIGHT_MS` (2 to 1024)."""
    return int(min(1024, max(2, -(-IN_FLIGHT_MS * 1e-3 // max(run_s, 1e-6)))))


def in_flight_wall(step, wait, reps) -> float:
    """Median wall seconds a step of ``step()`` calls issued back to back, with one ``wait()``
    at the end, for about :data:`IN_FLIGHT_MS` a timing (one step and its wait, untimed,
    size it). Our fed runs (:func:`_in_flight`) and FlashMLA's graph replays
    (``peers.FlashMLA.in_flight_time``) are timed by it."""
    t0 = time.perf_counter()
    step()
    wait()
    runs = in_flight_runs(time.perf_counter() - t0)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(runs):
            step()
        wait()
        walls.append((time.perf_counter() - t0) / runs)
    return statistics.median(walls)


def _in_flight(many, prev, args, reps) -> float:
    """Median seconds per run of ``many(prev, *args)`` dispatched back to back, each fed the
    last one's output (:func:`in_flight_wall`; a ``many`` that ignores it times runs with no
    dependency)."""
    last = [jax.block_until_ready(many(prev, *args))]  # compiles

    def step():
        last[0] = many(last[0], *args)

    return in_flight_wall(step, lambda: jax.block_until_ready(last[0]), reps)


def serial_inputs(args, n: int) -> tuple:
    """``chained(..., serial=True)``'s arguments for ``n`` calls of ``fn(*args)``: a buffer of
    its own for every call's first argument (XLA sees ``n`` distinct inputs), the rest shared."""
    return (tuple(jnp.array(args[0], copy=True) for _ in range(n)), *args[1:])


def dispatch_time(fn, *args, n: int | None = None, reps: int | None = None) -> float:
    """Seconds per call of ``n`` back-to-back jitted calls with one sync at the end.

    An upper bound on GPU time (exact once a call's GPU time exceeds its ~40 us host dispatch):
    the cross-check of :func:`device_time`.
    """
    n = (50 if REPS > 1 else 2) if n is None else n
    reps = min(3, REPS) if reps is None else reps
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))

    def run():
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / n

    return min(run() for _ in range(reps))


# Datasheet roofs of the fastest GPU we know of, for a sanity check of the measured ceilings.
_MAX_PLAUSIBLE_COPY = 8.5e12
_MAX_PLAUSIBLE_MATMUL = 2.6e15


@functools.cache
def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate measured here, now."""
    n = 1 << 29  # 1 GiB of bf16
    x = jax.random.normal(jax.random.key(2), (n,), jnp.bfloat16)
    # 1.25 is exact in bf16 (1.0001 rounds to 1.0, and XLA then drops the multiply entirely).
    t = device_time(lambda a: a * jnp.bfloat16(1.25), x)
    copy = 2 * n * 2 / t
    m = 8192
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    t = device_time(lambda p, q: (p @ q) * jnp.bfloat16(m**-0.5), a, b)
    matmul = 2 * m**3 / t
    plausible = copy <= _MAX_PLAUSIBLE_COPY and matmul <= _MAX_PLAUSIBLE_MATMUL
    if not plausible:
        import warnings

        warnings.warn(f"implausible ceilings (copy {copy:.3g} B/s, matmul {matmul:.3g} FLOP/s): "
                      f"the timing chain is broken", stacklevel=2)
    return {"copy_bytes_per_s": copy, "bf16_matmul_flops": matmul, "plausible": plausible}


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "platform": current_platform(),
        "num_sms": getattr(jax.devices()[0], "core_count", None),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_mla": jax_mla.__version__,
    }
    # Installed versions, read without importing: importing triton here would fix its mode
    # before jax_mla chooses the interpreter on CPU (TRITON_INTERPRET is read at import).
    for key, dist in (("jaxlib", "jaxlib"), ("triton", "triton"), ("jax_triton", "jax-triton"),
                      ("torch", "torch")):
        try:
            env[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[key] = None
    return env
