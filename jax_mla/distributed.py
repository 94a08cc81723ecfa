"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``), CPU or GPU.

Every process (one per host, or one per GPU) runs the same program. After :func:`initialize`,
``jax.devices()`` lists the devices of every process, a ``jax.sharding.Mesh`` spans them, and a
jitted program over that mesh runs its collectives across processes: NCCL between GPUs, gloo over
TCP between CPU devices. Decode context parallel needs nothing more: each process holds the cache
pages of its own devices (:func:`jax_mla.dcp_allocate_cache`) and only queries and LSE-weighted
partial outputs travel between ranks (docs/dcp.md, *Across processes and hosts*).

- :func:`detect`: this process's settings, from the environment (pure).
- :func:`initialize`: call once in every process, before anything touches a device.
- :func:`host_to_global`: a global array from a host value every process holds whole (block
  tables, lengths): each process uploads only its own devices' slices.
- :func:`guard` / :class:`ProcessLost`: a step's runtime error, when another process died,
  becomes an error naming that process.
- :func:`addressable_nbytes`, :func:`host_memory`: what this process holds.

Where the settings come from (first match; variables in ``jax_mla/env.py``):

1. ``JAX_MLA_NUM_PROCESSES`` set: ``JAX_MLA_COORDINATOR``, ``JAX_MLA_PROCESS_ID`` (what ``python
   -m jax_mla.launch`` sets; any launcher can set them);
2. torchrun's ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``: the coordinator on ``MASTER_ADDR`` at
   ``JAX_MLA_COORDINATOR_PORT`` (default ``MASTER_PORT + 1``, since torchrun's own store listens
   on ``MASTER_PORT``), this process's GPU ``LOCAL_RANK``;
3. a cluster jax detects by itself (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``): jax reads it;
4. none: a single process; :func:`initialize` does nothing.

Failures are bounded in time: a process that stops sending heartbeats for
``heartbeat_timeout_s`` is declared dead by the coordinator and every other process terminates
with ``The following tasks are unhealthy (stopped sending heartbeats): <ids>`` instead of waiting
in a collective for ever (``tests/test_multiprocess.py`` kills a process to check it); inside
:func:`guard` the error names the lost process first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import sys
import threading
import warnings
from collections.abc import Mapping

import jax
import numpy as np

from jax_mla import env

try:  # jax internals, for the one setting jax.distributed does not expose: gloo's address.
    from jax._src import distributed as _jax_distributed
    from jax._src import xla_bridge as _xla_bridge
    from jax._src.lib import _jax as _jaxlib
except ImportError:  # another layout of jax's internals: gloo keeps its own address
    _jax_distributed = _xla_bridge = _jaxlib = None

__all__ = [
    "DistributedConfig",
    "ProcessLost",
    "addressable_nbytes",
    "detect",
    "guard",
    "host_memory",
    "host_to_global",
    "initialize",
    "parse_address",
]

SOURCES = ("jax_mla", "torchrun", "cluster", "single")
_INITIALIZED: DistributedConfig | None = None  # what initialize() used (guard's default wait)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process's place in a multi-process run (:func:`detect`, :func:`initialize`).

    Attributes:
      source: where the settings came from: ``"jax_mla"`` (``JAX_MLA_*``), ``"torchrun"``,
        ``"cluster"`` (jax detects SLURM / Open MPI / ...), or ``"single"`` (one process).
      coordinator_address: ``host:port`` of process 0's coordinator service (None: jax finds it).
      num_processes, process_id: ``N`` and this process's id in ``[0, N)`` (None until jax has
        detected them, for ``"cluster"``).
      local_device_ids: the GPUs this process drives (None: every device it sees; CPU: ignored).
      heartbeat_timeout_s: a process silent this long is dead; the others then stop.
      initialization_timeout_s, shutdown_timeout_s: waits for every process to connect, and at
        the shutdown barrier. None: jax's defaults (100, 300, 300 s in jax 0.10).
      gloo_hostname: the address CPU collectives listen on (None: gloo's default, the address of
        the host's name).
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    heartbeat_timeout_s: int | None = None
    initialization_timeout_s: int | None = None
    shutdown_timeout_s: int | None = None
    gloo_hostname: str | None = None

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
        if self.coordinator_address is not None:
            parse_address(self.coordinator_address, "coordinator_address")
        n, pid = self.num_processes, self.process_id
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"num_processes must be an int >= 1, got {n!r}")
        if pid is not None and (not isinstance(pid, int) or not 0 <= pid < (n or pid + 1)):
            raise ValueError(f"process_id must be an int in [0, num_processes={n}), got {pid!r}")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a whole number of seconds >= 1, got {v!r}")

    @property
    def coordinator_bind_address(self) -> str | None:
        """Where process 0's coordinator listens: only on the loopback interface when the
        coordinator is a loopback address (a one-host run stays off the network), else jax's
        default (every interface)."""
        if self.coordinator_address is None:
            return None
        host, port = parse_address(self.coordinator_address, "coordinator_address")
        return self.coordinator_address if _is_loopback(host) else None


def parse_address(address: str, name: str = "address") -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` (``"[v6]:port"`` too); ``name`` is the argument an
    error names."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} must be host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _int_var(name: str, environ, *, low: int = 0) -> int | None:
    v = env.read_int(name, environ)
    if v is not None and v < low:
        raise ValueError(f"{name}={v} must be >= {low}")
    return v


def _device_ids(name: str, environ) -> tuple[int, ...] | None:
    v = env.read_str(name, environ)
    if v is None:
        return None
    try:
        ids = tuple(int(x) for x in v.split(","))
    except ValueError:
        raise ValueError(f"{name}={v!r} must be comma-separated device ids, e.g. 0,1") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{name}={v!r}: device ids are >= 0")
    return ids


def detect(environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """This process's :class:`DistributedConfig`, from ``environ`` (default: ``os.environ``).

    Pure: reads the variables of the module docstring (first matching source wins) and starts
    nothing. Errors name the variable and the rule (a missing partner variable, a bad number).
    """
    timeouts = dict(
        heartbeat_timeout_s=_int_var("JAX_MLA_HEARTBEAT_TIMEOUT", environ, low=1),
        initialization_timeout_s=_int_var("JAX_MLA_INIT_TIMEOUT", environ, low=1),
        shutdown_timeout_s=_int_var("JAX_MLA_SHUTDOWN_TIMEOUT", environ, low=1),
        gloo_hostname=env.read_str("JAX_MLA_GLOO_HOSTNAME", environ),
    )
    local_ids = _device_ids("JAX_MLA_LOCAL_DEVICE_IDS", environ)

    n = _int_var("JAX_MLA_NUM_PROCESSES", environ, low=1)
    if n is not None:
        missing = [v for v in ("JAX_MLA_COORDINATOR", "JAX_MLA_PROCESS_ID")
                   if env.read_str(v, environ) is None]
        if missing:
            raise ValueError(f"JAX_MLA_NUM_PROCESSES={n} is set but {' and '.join(missing)} "
                             f"not: set all three (python -m jax_mla.launch does)")
        return _with_gloo(DistributedConfig(
            "jax_mla", env.read_str("JAX_MLA_COORDINATOR", environ), n,
            _int_var("JAX_MLA_PROCESS_ID", environ), local_ids, **timeouts))

    world = _int_var("WORLD_SIZE", environ, low=1)
    rank, master = _int_var("RANK", environ), env.read_str("MASTER_ADDR", environ)
    if world is not None and rank is not None and master is not None:
        port = _int_var("JAX_MLA_COORDINATOR_PORT", environ, low=1)
        if port is None:
            master_port = _int_var("MASTER_PORT", environ, low=1)
            if master_port is None:
                raise ValueError("torchrun-style run (WORLD_SIZE, RANK, MASTER_ADDR set) without "
                                 "MASTER_PORT or JAX_MLA_COORDINATOR_PORT: set one")
            port = master_port + 1  # MASTER_PORT itself is torchrun's store
        local_rank = _int_var("LOCAL_RANK", environ)
        if local_ids is None and local_rank is not None:
            local_ids = (local_rank,)
        return _with_gloo(DistributedConfig("torchrun", f"{master}:{port}", world, rank,
                                            local_ids, **timeouts))

    if any(env.read_str(v, environ) is not None
           for v in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "JAX_COORDINATOR_ADDRESS")):
        return DistributedConfig("cluster", local_device_ids=local_ids, **timeouts)
    return DistributedConfig("single", num_processes=1, process_id=0, **timeouts)


def _with_gloo(cfg: DistributedConfig) -> DistributedConfig:
    """A loopback coordinator means every process is on this host: gloo listens there too."""
    if cfg.gloo_hostname is None and cfg.coordinator_bind_address is not None:
        host, _ = parse_address(cfg.coordinator_address, "coordinator_address")
        return dataclasses.replace(cfg, gloo_hostname=host)
    return cfg


def initialize(config: DistributedConfig | None = None, **overrides) -> DistributedConfig:
    """Join this process to the run: ``jax.distributed.initialize`` with bounded timeouts.

    Call it first, in every process, before any jax computation (jax refuses later). On CPU
    the cross-process collectives are gloo's (over TCP; listening on ``gloo_hostname`` when
    set); on GPUs, NCCL's.

    Args:
      config: the settings; default :func:`detect` ``()``.
      **overrides: fields of :class:`DistributedConfig` to replace (e.g.
        ``heartbeat_timeout_s=10``).
    Returns:
      The config used, with ``num_processes`` / ``process_id`` as jax sees them. A ``"single"``
      config (no variables set) starts nothing and returns at once.
    """
    cfg = detect() if config is None else config
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    if cfg.source == "single":
        return cfg
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialized in this process: call "
                           "jax_mla.distributed.initialize once, before any jax computation")
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {k: v for k, v in (
        ("coordinator_address", cfg.coordinator_address),
        ("num_processes", cfg.num_processes),
        ("process_id", cfg.process_id),
        ("local_device_ids", None if cfg.local_device_ids is None else list(cfg.local_device_ids)),
        ("coordinator_bind_address", cfg.coordinator_bind_address),
        ("heartbeat_timeout_seconds", cfg.heartbeat_timeout_s),
        ("initialization_timeout", cfg.initialization_timeout_s),
        ("shutdown_timeout_seconds", cfg.shutdown_timeout_s),
    ) if v is not None}
    jax.distributed.initialize(**kwargs)  # connects; no backend exists yet
    if cfg.gloo_hostname is not None and jax.config.jax_cpu_collectives_implementation == "gloo":
        _listen_gloo_on(cfg.gloo_hostname)
    if cfg.num_processes is None or cfg.process_id is None:  # detected by jax
        cfg = dataclasses.replace(cfg, num_processes=jax.process_count(),
                                  process_id=jax.process_index())
    global _INITIALIZED
    _INITIALIZED = cfg
    return cfg


def _listen_gloo_on(hostname: str) -> None:
    """Make the CPU client's gloo collectives listen on ``hostname``.

    jax builds them with gloo's default, the address of the host's name, which may be a public
    interface, or may not resolve inside a container; jax offers no setting. So the CPU backend's
    factory is replaced (before any backend exists) by jax's own, given gloo collectives made
    with ``hostname``. Where jax's internals differ, gloo keeps its default, with a warning.
    """
    make = getattr(_jaxlib, "make_gloo_tcp_collectives", None)
    make_client = getattr(_xla_bridge, "make_cpu_client", None)
    register = getattr(_xla_bridge, "register_backend_factory", None)
    if None in (make, make_client, register, _jax_distributed):
        warnings.warn(f"this jax ({jax.__version__}) has no known way to set gloo's address; "
                      f"CPU collectives keep gloo's default, not {hostname}", stacklevel=3)
        return

    def cpu_client():
        client = _jax_distributed.global_state.client
        return make_client(collectives=make(distributed_client=client, hostname=hostname))

    register("cpu", cpu_client, priority=0, fail_quietly=False)


# --------------------------------------------------------------------------------------------
# Failures: another process stopped
# --------------------------------------------------------------------------------------------


class ProcessLost(RuntimeError):
    """A collective across processes failed because another process of the run stopped.

    Attributes:
      lost: ids of the processes the coordinator no longer counts alive (never empty).
      process_id, num_processes: this process and the run's size.
    """

    def __init__(self, message: str, *, lost, process_id: int, num_processes: int):
        super().__init__(message)
        self.lost = list(lost)
        self.process_id = process_id
        self.num_processes = num_processes


@contextlib.contextmanager
def guard(what: str = "the step", *, wait_s: float | None = None):
    """Name the process that stopped when a step's collective fails because of it.

    When a process of the run dies (crash, kill, out of memory) its peers' collectives fail,
    gloo's often at once (``Connection reset by peer [127.0.0.1]:port``), and in any case the
    runtime stops every process once the dead one has missed its heartbeats. The collective's
    error does not say which process died. Inside ``with guard():`` a
    ``jax.errors.JaxRuntimeError`` of a multi-process run makes this process ask the
    coordinator which processes are still alive (waiting at most ``wait_s``, by default the
    heartbeat timeout plus 5 s) and raise :class:`ProcessLost` naming the others. When every
    process is alive, or the coordinator cannot tell within the wait, the error is this
    process's own and is re-raised as it was (after that wait: the others are then blocked
    waiting for this one, so the run is over either way).

    Put the point where results are awaited inside the block (``jax.block_until_ready``, a
    host copy): dispatch is asynchronous, and that is where a step's error surfaces.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        n = jax.process_count()
        if n == 1:
            raise
        me = jax.process_index()
        if wait_s is None:
            hb = _INITIALIZED.heartbeat_timeout_s if _INITIALIZED is not None else None
            wait_s = (hb or 100) + 5
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"jax_mla: process {me} of {n}: {what} failed in the runtime ({first}); asking "
              f"the coordinator which processes are alive (up to {wait_s:g} s)", file=sys.stderr,
              flush=True)
        lost = _lost_processes(n, wait_s)
        if not lost:
            raise
        raise ProcessLost(
            f"process {me} of {n}: {what} failed because another process of the run is gone: "
            f"process(es) {', '.join(map(str, lost))} stopped (crashed, killed or out of "
            f"memory: see its own log). This process stops too; restart the whole run. The "
            f"runtime's error: {first}", lost=lost, process_id=me, num_processes=n) from e


def _lost_processes(n: int, wait_s: float) -> list[int] | None:
    """Process ids the coordinator no longer counts alive; None when it cannot tell in time.

    ``get_live_nodes`` returns once every live process has asked (or been declared dead after
    its heartbeat timeout), so it runs in a thread and is abandoned after ``wait_s``.
    """
    client = getattr(getattr(_jax_distributed, "global_state", None), "client", None)
    live_nodes = getattr(client, "get_live_nodes", None)
    if live_nodes is None:
        return None
    box: dict = {}

    def ask():
        try:
            box["live"] = live_nodes(list(range(n)))
        except Exception as e:  # the coordinator itself is gone (process 0 died)
            box["error"] = e

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(wait_s)
    if "live" in box:
        return sorted(set(range(n)) - set(box["live"]))
    if "error" in box and 0 != jax.process_index():
        return [0]  # process 0 hosts the coordinator: unreachable means it is gone
    return None


# --------------------------------------------------------------------------------------------
# Arrays and memory of one process
# --------------------------------------------------------------------------------------------


def host_to_global(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global ``jax.Array`` from a host value every process holds whole.

    For small per-step inputs that every process computes identically (block tables ``[N, B,
    pages]`` from the same :class:`jax_mla.PagedCacheManager`, lengths, positions): each process
    copies only the slices its own devices hold. Unlike ``jax.device_put``, nothing is sent
    between processes (``device_put`` gathers the value to check that the processes agree);
    the processes must agree, as in any SPMD program.

    Args:
      x: array-like ``[...]``, the whole global value.
      sharding: its layout over the mesh (e.g. ``dcp_shardings(mesh).block_tables``).
    Returns:
      ``jax.Array`` of ``x``'s shape and dtype with that sharding. Not jittable (host data).
    """
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def addressable_nbytes(x: jax.Array, *, distinct: bool = False) -> int:
    """Bytes of ``x`` on this process's devices.

    ``distinct=True`` counts each slice once however many local devices hold a copy (a cache
    replicated over a head-parallel axis), i.e. the share of the global array this process
    holds; ``False`` counts every device buffer (the device memory it takes).
    """
    shards = x.addressable_shards
    if distinct:
        shards = list({_index_key(s.index): s for s in shards}.values())
    return int(sum(s.data.nbytes for s in shards))


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def host_memory() -> dict[str, int | None]:
    """This process's resident host memory now and at its peak, bytes (``VmRSS`` / ``VmHWM``
    from ``/proc/self/status``; None where there is no such file)."""
    out: dict[str, int | None] = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    keys = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes"}
    for line in lines:
        parts = line.split()
        if parts and parts[0] in keys and len(parts) >= 2:
            out[keys[parts[0]]] = int(parts[1]) * 1024  # kB
    return out
