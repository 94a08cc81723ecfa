"""DCP across processes on jax's own multi-controller runtime, over loopback.

Every run here is ``jax_mla.launch``: 2 or 4 processes of 2 CPU devices each on free local ports,
the coordinator and the collectives (gloo on CPU, NCCL on GPUs) on 127.0.0.1, each run bounded
by the launcher's timeout (everything is killed when it passes), so nothing can hang.

- ``tests/multiprocess_worker.py dcp``: a serving loop's decode and verify steps on a cache each
  process allocates and writes for its own devices only, on a 1-D DCP mesh (interleave 1) and a
  2-D DCP x head-parallel mesh (interleave 2), against the float64 single-device oracle; each
  process holds 1/N of the cache, no collective moves a cache-sized array, every socket is on
  loopback.
- ``... prefill``: the model layer's prompt chunks over a cached context spread over both
  processes (with a decode row), against the single-device layer.
- ``... fault``: one process exits abruptly inside a step; the others stop with an error naming
  it, within the heartbeat timeout.
- The launcher itself (failure and timeout handling, each process's environment), settings
  detection, and two launchers joined as two "hosts".

On a GPU host the same tests run one process per GPU over NCCL (skipped where there are too
few GPUs); they have not run on GPUs yet.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla import distributed
from jax_mla.launch import free_port, launch

from conftest import SEED

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")
PLATFORM = jax.default_backend()
# CPU: two simulated devices per process (so a 2-D mesh has a head axis inside a process);
# GPUs: one process per GPU, as deployed.
DEVICES_PER_PROC = 2 if PLATFORM == "cpu" else 1
HEARTBEAT_S = 10  # how soon the runtime declares a silent process dead (jax's default: 100)
TOL = 1e-5


def _child_env() -> dict:
    env = dict(os.environ)
    if PLATFORM == "gpu":
        # Several processes share the host's GPUs with this one: no 75 % preallocation each;
        # NCCL's bootstrap on loopback like everything else.
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_SOCKET_IFNAME="lo")
    return env


def _needs(nprocs: int):
    """GPUs: ``nprocs * DEVICES_PER_PROC`` of them; on CPU every count runs (simulated)."""
    if PLATFORM != "cpu" and len(jax.devices()) < nprocs * DEVICES_PER_PROC:
        pytest.skip(f"{nprocs} processes x {DEVICES_PER_PROC} {PLATFORM} devices need "
                    f"{nprocs * DEVICES_PER_PROC}, this host has {len(jax.devices())}")


def _run_worker(mode, nprocs, *args, timeout_s, on_failure="kill"):
    return launch([WORKER, mode, "--seed", str(SEED), *map(str, args)], nprocs=nprocs,
                  devices_per_proc=DEVICES_PER_PROC, timeout_s=timeout_s,
                  heartbeat_timeout_s=HEARTBEAT_S, on_failure=on_failure, env=_child_env())


def _tail(text: str) -> str:
    """The end of a process's output, without gloo's connection notices."""
    return "\n".join(ln for ln in text.splitlines() if "[Gloo]" not in ln)[-6000:]


def _results(r, nprocs) -> list[dict]:
    assert r.returncode == 0, (r.message, _tail(r.output(r.failed_rank or 0)))
    out = []
    for i in range(nprocs):
        lines = [ln for ln in r.output(i).splitlines() if ln.startswith("RESULT ")]
        assert lines, f"process {i} printed no RESULT line:\n{_tail(r.output(i))}"
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


# ------------------------------------------------------------------------------------------------
# DCP decode and verify across 2 and 4 processes
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def dcp_run(request):
    """One launch per process count, shared by the tests below: ``(N, [result per process])``."""
    nprocs = request.param
    _needs(nprocs)
    r = _run_worker("dcp", nprocs, timeout_s=240)
    results = _results(r, nprocs)
    print(f"{nprocs} processes: {r.message}")
    return nprocs, results


def test_dcp_across_processes_matches_single_device(dcp_run):
    nprocs, results = dcp_run
    ndev = nprocs * DEVICES_PER_PROC
    for res in results:
        assert (res["num_processes"], res["device_count"]) == (nprocs, ndev)
        assert res["config_source"] == "jax_mla"
        for name, case in res["cases"].items():
            assert case["dcp"] * case["tp"] == ndev, name
            assert sorted(case["devices"]) == sorted(results[0]["cases"][name]["devices"])
            for what in ("decode", "verify"):
                e = case[what]
                print(f"process {res['rank']} {name} {what}: out {e['out_rel_err']:.1e} "
                      f"lse {e['lse_rel_err']:.1e}")
                assert e["out_rel_err"] < TOL and e["lse_rel_err"] < TOL, (name, what, e)
    # Every process drives its own devices, and they are all different.
    local = [tuple(res["cases"]["dcp_1d"]["local_devices"]) for res in results]
    assert len(set(local)) == nprocs and all(len(d) == DEVICES_PER_PROC for d in local)
    # The layouts asked for: interleave 1 on the 1-D mesh, 2 on DCP x head parallel.
    c = results[0]["cases"]
    assert (c["dcp_1d"]["interleave"], c["dcp_x_tp"]["interleave"]) == (1, 2)
    assert (c["dcp_x_tp"]["dcp"], c["dcp_x_tp"]["tp"]) == (ndev // 2, 2)


def test_each_process_holds_one_nth_of_the_cache(dcp_run):
    """Allocated in place (``dcp_allocate_cache``) and written in place: a process's devices
    hold its own DCP ranks' pages and nothing else. On the 1-D mesh that is 1/N of the cache;
    on the 2-D mesh with two devices per process, the two head-parallel replicas of one rank."""
    nprocs, results = dcp_run
    for res in results:
        for name, case in res["cases"].items():
            tp, dcp = case["tp"], case["dcp"]
            ranks_here = max(DEVICES_PER_PROC // tp, 1)  # make_mesh: a process's devices in a row
            assert case["cache_bytes_distinct"] * dcp == case["cache_bytes_global"] * ranks_here
            assert case["cache_bytes_held"] == case["cache_bytes_distinct"] * min(
                tp, DEVICES_PER_PROC), name
        one_d = res["cases"]["dcp_1d"]
        assert one_d["cache_bytes_distinct"] * nprocs == one_d["cache_bytes_global"]


def test_no_collective_moves_the_cache(dcp_run):
    """The compiled step (write + metadata + attention) only gathers queries and LSEs and
    combines partial outputs: nothing near a rank's cache travels between processes."""
    _, results = dcp_run
    for name, case in results[0]["cases"].items():
        for what in ("decode", "verify"):
            e = case[what]
            assert e["biggest_collective_elems"] < e["rank_cache_elems"] // 4, (name, what, e)
            assert set(e["collective_ops"]) <= {"all-gather", "reduce-scatter", "all-to-all"}
            assert "all-gather" in e["collective_ops"], e  # the query gather: the parse works


def test_all_traffic_stays_on_loopback(dcp_run):
    _, results = dcp_run
    for res in results:
        socks = res["tcp_sockets"]
        if socks is None:
            pytest.skip("no /proc/self/net/tcp on this platform: sockets not inspected")
        assert socks, "no TCP socket found: the inspection is broken"
        for s in socks:
            ends = [s["local"]] if s["listen"] else [s["local"], s["remote"]]
            for end in ends:
                host = end.rsplit(":", 1)[0]
                assert host.startswith("127.") or host == "::1", (res["rank"], s)


def test_layer_prefill_over_sharded_context_across_processes():
    """The model layer across 2 processes: prompt chunks over a cached context spread over
    every process's devices (with a decode row in the step) equal the single-device layer; the
    cache stays where it is."""
    nprocs = 2
    _needs(nprocs)
    results = _results(_run_worker("prefill", nprocs, timeout_s=240), nprocs)
    for res in results:
        case = res["prefill"]
        assert case["dcp"] == nprocs * DEVICES_PER_PROC
        assert case["cache_bytes_distinct"] * nprocs == case["cache_bytes_global"]
        assert [s["context"] for s in case["steps"]] == [[0, 0, 0], [11, 2, 0]]
        for s in case["steps"]:
            print(f"process {res['rank']} context {s['context']}: out {s['out_rel_err']:.1e}")
            assert s["out_rel_err"] < TOL, (res["rank"], s)
            assert s["biggest_collective_elems"] < case["rank_cache_elems"] // 4, s
            assert "all-to-all" in s["collective_ops"], s  # the combine: the parse works


# ------------------------------------------------------------------------------------------------
# A process dies inside a step
# ------------------------------------------------------------------------------------------------


def _names_the_dead(text: str, dead: int) -> bool:
    """Our ProcessLost, or the runtime's own verdicts (heartbeats missed; leader gone)."""
    pats = [rf"process\(es\) {dead} stopped",
            rf"stopped sending heartbeats\):\s*{dead}\b"]
    if dead == 0:
        pats.append(r"leader task was preempted/died")
    return any(re.search(p, text) for p in pats)


@pytest.mark.parametrize("nprocs,dead", [(2, 1), (2, 0), (4, 2)])
def test_a_dead_process_stops_the_others_with_a_clear_error(nprocs, dead):
    """Process ``dead`` leaves with ``os._exit`` inside step 1 (a host callback before the
    step's first collective). The launcher lets the others run on their own
    (``on_failure="wait"``): each must exit non-zero within the heartbeat timeout (plus
    margin), never finish the step, and say which process is gone."""
    _needs(nprocs)
    r = _run_worker("fault", nprocs, "--die-rank", dead, "--die-step", 1, timeout_s=150,
                    on_failure="wait")
    assert not r.timed_out, ("a survivor hung", r.message, r.exit_s)
    assert r.returncodes[dead] == 17, _tail(r.output(dead))
    for i in range(nprocs):
        if i == dead:
            continue
        out = r.output(i)
        waited = r.exit_s[i] - r.exit_s[dead]
        print(f"process {i}: exit {r.returncodes[i]} {waited:.1f} s after process {dead}")
        assert r.returncodes[i] != 0, _tail(out)
        assert "step 1 done" not in out
        assert waited < HEARTBEAT_S + 15, (i, waited)
        assert _names_the_dead(out, dead), _tail(out)


# ------------------------------------------------------------------------------------------------
# The launcher and the settings
# ------------------------------------------------------------------------------------------------


def test_launcher_stops_the_run_when_one_process_fails():
    code = ("import os, sys, time; r = int(os.environ['JAX_MLA_PROCESS_ID']); "
            "print('up', r, flush=True); time.sleep(0.3); sys.exit(3) if r == 1 else "
            "time.sleep(120)")
    r = launch(["-c", code], nprocs=3, timeout_s=60, grace_s=2)
    assert (r.returncode, r.failed_rank, sorted(r.killed)) == (3, 1, [0, 2]), r
    assert r.elapsed_s < 20 and "process 1 exited with code 3" in r.message
    assert all(r.output(i).startswith(f"up {i}") for i in range(3))


def test_launcher_timeout_kills_everything():
    r = launch(["-c", "import time; time.sleep(120)"], nprocs=2, timeout_s=1.0, grace_s=2)
    assert r.timed_out and r.returncode == 124 and sorted(r.killed) == [0, 1], r
    assert r.elapsed_s < 20 and "timed out" in r.message


def test_launcher_gives_each_process_its_place():
    code = ("import os; print(*(os.environ[k] for k in ('JAX_MLA_COORDINATOR', "
            "'JAX_MLA_NUM_PROCESSES', 'JAX_MLA_PROCESS_ID', 'JAX_MLA_LOCAL_DEVICE_IDS', "
            "'JAX_MLA_HEARTBEAT_TIMEOUT', 'XLA_FLAGS')))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"}
    r = launch(["-c", code], nprocs=2, devices_per_proc=3, nnodes=2, node_rank=1,
               coordinator="10.1.2.3:4567", heartbeat_timeout_s=7, env=env)
    assert r.returncode == 0, r
    for local, pid in enumerate((2, 3)):
        words = r.output(pid).split()
        ids = ",".join(str(local * 3 + j) for j in range(3))
        assert words == ["10.1.2.3:4567", "4", str(pid), ids, "7", "--xla_foo=1",
                         "--xla_force_host_platform_device_count=3"], words


def test_launcher_command_line():
    """``python -m jax_mla.launch``: output prefixed by process, the failure's exit code."""
    code = "import os, sys; print('hi'); sys.exit(int(os.environ['JAX_MLA_PROCESS_ID']) * 5)"
    res = subprocess.run([sys.executable, "-m", "jax_mla.launch", "--nprocs", "2", "--timeout",
                          "60", "--", "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 5, res.stderr
    assert "[rank 0] hi" in res.stdout and "[rank 1] hi" in res.stdout
    assert "process 1 exited with code 5" in res.stderr
    bad = subprocess.run([sys.executable, "-m", "jax_mla.launch", "--nprocs", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give the command after --" in bad.stderr


def test_two_launchers_join_as_two_hosts():
    """What a two-host launch does (docs/dcp.md), on one host: two launchers of one process
    each, one coordinator; a sum over every device sees both processes."""
    script = textwrap.dedent("""
        import numpy as np
        import jax_mla
        cfg = jax_mla.distributed.initialize()
        import jax
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        x = jax_mla.distributed.host_to_global(np.arange(8.0), sh)
        print("sum", float(jax.jit(lambda a: a.sum(), out_shardings=sh.update(spec=()))(x)),
              "procs", jax.process_count(), "id", cfg.process_id, flush=True)
    """)
    _needs(2)
    coord = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_mla.launch", "--nprocs", "1",
         "--devices-per-proc", str(DEVICES_PER_PROC),
         "--nnodes", "2", "--node-rank", str(k), "--coordinator", coord, "--timeout", "90",
         "--", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_child_env()) for k in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        finally:
            if p.poll() is None:
                p.kill()  # only if the launcher's own timeout failed
    for k, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, _tail(out)
        assert f"[rank {k}] sum 28.0 procs 2 id {k}" in out, _tail(out)


def test_detect_reads_each_source():
    d = distributed.detect
    assert d({}).source == "single" and d({}).num_processes == 1
    cfg = d({"JAX_MLA_NUM_PROCESSES": "4", "JAX_MLA_PROCESS_ID": "3",
             "JAX_MLA_COORDINATOR": "127.0.0.1:1234", "JAX_MLA_LOCAL_DEVICE_IDS": "6,7",
             "JAX_MLA_HEARTBEAT_TIMEOUT": "5"})
    assert (cfg.source, cfg.num_processes, cfg.process_id, cfg.local_device_ids,
            cfg.heartbeat_timeout_s) == ("jax_mla", 4, 3, (6, 7), 5)
    # Loopback coordinator: the service and gloo listen on loopback only.
    assert cfg.coordinator_bind_address == "127.0.0.1:1234" and cfg.gloo_hostname == "127.0.0.1"
    tr = d({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500"})
    assert (tr.source, tr.coordinator_address, tr.num_processes, tr.process_id,
            tr.local_device_ids) == ("torchrun", "10.0.0.1:29501", 8, 5, (1,))
    assert tr.coordinator_bind_address is None and tr.gloo_hostname is None
    assert d({"SLURM_JOB_ID": "42"}).source == "cluster"


@pytest.mark.parametrize("environ,match", [
    ({"JAX_MLA_NUM_PROCESSES": "2"}, "JAX_MLA_COORDINATOR and JAX_MLA_PROCESS_ID"),
    ({"JAX_MLA_NUM_PROCESSES": "2", "JAX_MLA_PROCESS_ID": "2",
      "JAX_MLA_COORDINATOR": "h:1"}, r"process_id must be an int in \[0, num_processes=2\)"),
    ({"JAX_MLA_NUM_PROCESSES": "2", "JAX_MLA_PROCESS_ID": "0",
      "JAX_MLA_COORDINATOR": "nohostport"}, "must be host:port"),
    ({"JAX_MLA_NUM_PROCESSES": "two"}, "JAX_MLA_NUM_PROCESSES='two' must be an integer"),
    ({"JAX_MLA_LOCAL_DEVICE_IDS": "0;1"}, "comma-separated device ids"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT or JAX_MLA_"),
])
def test_detect_errors_name_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        distributed.detect(environ)


def test_multihost_bench_quick(tmp_path):
    """``python -m jax_mla.bench.dcp_multihost --sweep``: each process holds 1/N of the cache,
    which halves from one process to two (up to page rounding); every figure is there."""
    _needs(2)
    res = subprocess.run([sys.executable, "-m", "jax_mla.bench.dcp_multihost", "--quick",
                          "--sweep", "1,2", "--devices-per-proc", str(DEVICES_PER_PROC),
                          "--timeout", "120", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=_child_env())
    assert res.returncode == 0, _tail(res.stdout + res.stderr)
    print(res.stdout)
    with open(tmp_path / "dcp_multihost.json") as f:
        rows = json.load(f)["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    for r in rows:
        assert all(p["cache_bytes"] * r["processes"] == r["cache_bytes_global"]
                   for p in r["per_process"]), r
    one, two = rows[0]["per_process"], rows[1]["per_process"]
    assert all(abs(2 * p["cache_bytes"] / one[0]["cache_bytes"] - 1) < 0.02 for p in two)
    for p in one + two:
        assert p["step_us"] > 0 and p["peak_rss_bytes"] > p["cache_bytes"] > 0


# ------------------------------------------------------------------------------------------------
# The single-process pieces (this process's own devices)
# ------------------------------------------------------------------------------------------------


def test_allocate_cache_in_place():
    """Each device's buffer is its own pages only, filled in place."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((2, 2), ("dcp", "tp"))
    kv = jax_mla.dcp_allocate_cache(5, 4, 48, mesh=mesh, dtype=jnp.bfloat16, fill_value=np.nan)
    assert kv.shape == (10, 4, 48) and kv.dtype == jnp.bfloat16
    assert kv.sharding.is_equivalent_to(jax_mla.dcp_shardings(mesh).kv_cache, 3)
    assert {s.data.shape for s in kv.addressable_shards} == {(5, 4, 48)}
    assert np.isnan(np.asarray(kv, np.float32)).all()
    assert distributed.addressable_nbytes(kv) == 2 * distributed.addressable_nbytes(
        kv, distinct=True) == 2 * kv.size * 2
    for bad, match in ((dict(pages_per_rank=0), "pages_per_rank must be a positive int"),
                       (dict(dcp_axis="x"), "dcp_axis='x' is not an axis")):
        with pytest.raises(ValueError, match=match):
            jax_mla.dcp_allocate_cache(**{"pages_per_rank": 5, "page_size": 4, "width": 48,
                                          "mesh": mesh, **bad})


def test_single_process_pieces():
    """``host_to_global`` equals ``device_put``; ``guard`` re-raises a one-process error as it
    was; ``initialize`` with no settings starts nothing."""
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    x = np.arange(4.0 * len(jax.devices())).reshape(len(jax.devices()), 4)
    g = distributed.host_to_global(x, sh)
    assert g.sharding == sh and np.array_equal(np.asarray(g), x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="boom"):
        with distributed.guard():
            raise jax.errors.JaxRuntimeError("boom")
    assert distributed.initialize(distributed.detect({})).source == "single"
    mem = distributed.host_memory()
    assert mem["peak_rss_bytes"] is None or mem["peak_rss_bytes"] >= mem["rss_bytes"] > 0
