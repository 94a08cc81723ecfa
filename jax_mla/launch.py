"""``python -m jax_mla.launch --nprocs N [options] -- script.py [args]``: N processes, one run.

Starts ``N`` copies of a Python command on this host as the processes of one
:func:`jax_mla.distributed.initialize` run, each told its place through ``JAX_MLA_COORDINATOR``,
``JAX_MLA_NUM_PROCESSES``, ``JAX_MLA_PROCESS_ID`` and ``JAX_MLA_LOCAL_DEVICE_IDS`` (and, on CPU,
``--devices-per-proc`` devices each); streams their output prefixed ``[rank r]``; and stops the
run as soon as one process fails (the others are killed, the launcher exits with the failed
process's code) or ``--timeout`` passes (everything is killed; exit code 124). Nothing is left
running either way.

Several hosts: run the launcher once per host with ``--nnodes M --node-rank R --coordinator
HOST:PORT`` (the same coordinator, on node 0, everywhere); process ids are ``R * N + local``.
Cluster schedulers (SLURM, Open MPI, torchrun) need no launcher: :func:`jax_mla.distributed.detect`
reads their variables (docs/dcp.md, *Across processes and hosts*).

Usable from Python too: :func:`launch` returns a :class:`LaunchResult` with every process's exit
code and output (the tests use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from jax_mla.distributed import parse_address

TIMEOUT_EXIT = 124  # like coreutils' timeout(1)
ON_FAILURE = ("kill", "wait")


@dataclasses.dataclass
class LaunchResult:
    """What a :func:`launch` run did.

    Attributes:
      returncodes: each local process's exit code (negative: killed by that signal).
      outputs: each local process's stdout and stderr, interleaved as written.
      elapsed_s: wall time from the first start to the last exit.
      failed_rank: the first process (global id) to exit non-zero, or None.
      timed_out: the timeout passed and the processes still running were killed.
      killed: global ids of the processes the launcher stopped.
      message: the launcher's verdict, one line (also printed by ``main``).
      exit_s: when each local process exited, seconds after the start (to 0.05 s).
    """

    returncodes: list[int]
    outputs: list[str]
    elapsed_s: float
    failed_rank: int | None
    timed_out: bool
    killed: list[int]
    message: str
    exit_s: list[float] = dataclasses.field(default_factory=list)
    first_rank: int = 0  # global id of outputs[0] / returncodes[0]

    @property
    def returncode(self) -> int:
        """0 when every process succeeded; 124 on timeout; else the first failure's code
        (``128 + signal`` for a process killed by a signal, as shells report it)."""
        if self.timed_out:
            return TIMEOUT_EXIT
        if self.failed_rank is None:
            return 0
        rc = self.returncodes[self.failed_rank - self.first_rank]
        return 128 - rc if rc < 0 else rc

    def output(self, rank: int) -> str:
        """The output of global process ``rank`` (one of this launcher's)."""
        return self.outputs[rank - self.first_rank]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the OS's choice; a later bind by another
    program can still take it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(base: Mapping[str, str], *, process_id: int, num_processes: int,
             local_index: int, devices_per_proc: int, coordinator: str,
             heartbeat_timeout_s: int | None = None) -> dict[str, str]:
    """The environment of one process: ``base`` plus its place in the run.

    ``JAX_MLA_LOCAL_DEVICE_IDS`` gives local process ``i`` the GPUs ``[i * K, (i + 1) * K)``;
    on CPU, ``XLA_FLAGS`` and ``JAX_NUM_CPU_DEVICES`` give it ``K`` devices (a device count
    already in ``XLA_FLAGS`` is replaced).
    """
    e = dict(base)
    k = devices_per_proc
    flags = [f for f in e.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    e.update({
        "JAX_MLA_COORDINATOR": coordinator,
        "JAX_MLA_NUM_PROCESSES": str(num_processes),
        "JAX_MLA_PROCESS_ID": str(process_id),
        "JAX_MLA_LOCAL_DEVICE_IDS": ",".join(str(local_index * k + j) for j in range(k)),
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={k}"]),
        "JAX_NUM_CPU_DEVICES": str(k),
        "PYTHONUNBUFFERED": "1",  # lines reach the launcher as they are written
    })
    if heartbeat_timeout_s is not None:
        e["JAX_MLA_HEARTBEAT_TIMEOUT"] = str(heartbeat_timeout_s)
    return e


def _positive(name: str, v, *, allow_none: bool = False):
    if v is None and allow_none:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")
    return v


def launch(command: Sequence[str], *, nprocs: int, devices_per_proc: int = 1,
           nnodes: int = 1, node_rank: int = 0, coordinator: str | None = None,
           timeout_s: float | None = None, heartbeat_timeout_s: int | None = None,
           on_failure: str = "kill", grace_s: float = 5.0,
           env: Mapping[str, str] | None = None, echo: TextIO | None = None) -> LaunchResult:
    """Run ``nprocs`` processes of ``python <command>`` as one multi-process run; wait for all.

    Args:
      command: the arguments after ``python``: ``["script.py", ...]``, ``["-m", "pkg.mod",
        ...]`` or ``["-c", "code"]``; run with this interpreter (``sys.executable``).
      nprocs: processes on this host (``N``). devices_per_proc: ``K`` devices each.
      nnodes, node_rank: several hosts, each running one launcher: this host's processes are
        ``node_rank * N + i`` of ``nnodes * N``; ``coordinator`` is then required.
      coordinator: ``host:port`` of process 0's coordinator; default ``127.0.0.1`` at a free
        port (one host, loopback only).
      timeout_s: kill everything after this long (None: no limit).
      heartbeat_timeout_s: passed on (``JAX_MLA_HEARTBEAT_TIMEOUT``): how soon the runtime
        declares a silent process dead.
      on_failure: ``"kill"``: stop the others as soon as one exits non-zero; ``"wait"``: let
        them finish or fail on their own (still bounded by ``timeout_s``).
      grace_s: after SIGTERM, how long a process has before SIGKILL.
      env: the processes' base environment (default ``os.environ``).
      echo: where to stream ``[rank r] line`` as output arrives (None: only collect it).
    Returns:
      :class:`LaunchResult`.
    """
    if not command:
        raise ValueError("command is empty: give a script (and its arguments) after --")
    nprocs, nnodes = int(_positive("nprocs", nprocs)), int(_positive("nnodes", nnodes))
    devices_per_proc = int(_positive("devices_per_proc", devices_per_proc))
    _positive("timeout_s", timeout_s, allow_none=True)
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure={on_failure!r} must be one of {ON_FAILURE}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} must lie in [0, nnodes={nnodes})")
    if coordinator is None:
        if nnodes > 1:
            raise ValueError("nnodes > 1 needs coordinator=HOST:PORT, the same on every host "
                             "(an address of node 0 the other hosts reach)")
        coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    parse_address(coordinator, "coordinator")
    base = dict(os.environ if env is None else env)
    first = node_rank * nprocs
    world = nnodes * nprocs
    lock = threading.Lock()
    outputs: list[list[str]] = [[] for _ in range(nprocs)]

    def pump(i, stream):
        for line in iter(stream.readline, ""):
            outputs[i].append(line)
            if echo is not None:
                with lock:
                    echo.write(f"[rank {first + i}] {line}")
                    echo.flush()
        stream.close()

    procs, readers = [], []
    exits: list[float | None] = [None] * nprocs
    start = time.monotonic()
    try:
        for i in range(nprocs):
            e = rank_env(base, process_id=first + i, num_processes=world, local_index=i,
                         devices_per_proc=devices_per_proc, coordinator=coordinator,
                         heartbeat_timeout_s=heartbeat_timeout_s)
            # Own session = own process group: stopping a rank also stops anything it started.
            p = subprocess.Popen([sys.executable, *command], env=e, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, errors="replace",
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=pump, args=(i, p.stdout), daemon=True)
            t.start()
            readers.append(t)
        failed, timed_out = _wait(procs, start, timeout_s, on_failure, exits)
    finally:
        killed = _stop([p for p in procs if p.poll() is None], grace_s)
        now = time.monotonic() - start
        exits[:] = [now if t is None else t for t in exits]
    for t in readers:
        t.join(timeout=grace_s)
    elapsed = time.monotonic() - start
    codes = [p.returncode for p in procs]
    killed_ids = [first + procs.index(p) for p in killed]
    result = LaunchResult(codes, ["".join(o) for o in outputs], elapsed,
                          None if failed is None else first + failed, timed_out, killed_ids, "",
                          exit_s=list(exits), first_rank=first)
    result.message = _verdict(result, timeout_s, command)
    return result


def _wait(procs, start, timeout_s, on_failure, exits):
    """Poll until every process exits, one fails (``kill``), or the timeout passes; ``exits[i]``
    gets process ``i``'s exit time. Returns ``(index of the first failure or None,
    timed_out)``."""
    failed = None
    while True:
        running = False
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                running = True
                continue
            if exits[i] is None:
                exits[i] = time.monotonic() - start
            if rc != 0 and failed is None:
                failed = i
        if failed is not None and on_failure == "kill":
            return failed, False
        if not running:
            return failed, False
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return failed, True
        time.sleep(0.05)


def _stop(procs, grace_s):
    """SIGTERM each process group, SIGKILL what is left after ``grace_s``; returns them."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()
    return procs


def _signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)  # the group this launcher created for it (start_new_session)
    except ProcessLookupError:
        pass


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


def _verdict(r: LaunchResult, timeout_s, command) -> str:
    what = f"{len(r.returncodes)} process(es) of {shlex.join(command)}"
    others = ", ".join(str(k) for k in r.killed)
    if r.timed_out:
        return (f"jax_mla.launch: timed out after {timeout_s:g} s (--timeout); killed "
                f"process(es) {others or 'none'} still running")
    if r.failed_rank is not None:
        rc = r.returncodes[r.failed_rank - r.first_rank]
        tail = f"; stopped process(es) {others}" if others else ""
        return (f"jax_mla.launch: process {r.failed_rank} exited with {_describe(rc)} after "
                f"{r.elapsed_s:.1f} s{tail}")
    return f"jax_mla.launch: {what} finished in {r.elapsed_s:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        command, argv = [], argv
    else:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(
        prog="python -m jax_mla.launch",
        usage="python -m jax_mla.launch --nprocs N [options] -- script.py [args] | -m module ...",
        description="Run N processes of one jax.distributed run on this host.")
    p.add_argument("--nprocs", type=int, required=True, help="processes on this host")
    p.add_argument("--devices-per-proc", type=int, default=1,
                   help="devices of each process: GPUs [i*K, (i+1)*K), or K CPU devices")
    p.add_argument("--nnodes", type=int, default=1, help="hosts, one launcher on each")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index (0: coordinator)")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0 (default 127.0.0.1 at a free port)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before killing the run")
    p.add_argument("--heartbeat-timeout", type=int, default=None,
                   help="seconds of silence after which the runtime declares a process dead")
    p.add_argument("--on-failure", choices=ON_FAILURE, default="kill",
                   help="kill: stop the others when one fails (default); wait: let them end")
    args = p.parse_args(argv)
    # A SIGTERM to the launcher (a scheduler's cancel) unwinds through launch(), whose cleanup
    # stops every process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if not command:
        p.error("give the command after --, e.g. -- script.py or -- -m package.module")
    try:
        r = launch(command, nprocs=args.nprocs, devices_per_proc=args.devices_per_proc,
                   nnodes=args.nnodes, node_rank=args.node_rank, coordinator=args.coordinator,
                   timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout,
                   on_failure=args.on_failure, echo=sys.stdout)
    except ValueError as e:
        p.error(str(e))
    print(r.message, file=sys.stderr, flush=True)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
