"""``python -m jax_mla.bench.report``: the A/B and command-buffer sections come from their JSON
files, with the figures as measured, and are left out where a folder has no such file."""

import json

import numpy as np

from jax_mla.bench import report


def _ab_row(rng, shape, variant):
    return {"shape": shape, "variant": variant, "best_us": float(rng.uniform(10, 900)),
            "vs_first": float(rng.uniform(0.5, 2)), "gpu_us": float(rng.uniform(10, 900)),
            "rel_err_vs_first": float(rng.uniform(0, 1e-3))}


def _ours_and_peer(rng, shape, ours=(), peer=()):
    """Our row and FlashMLA's at ``shape``, each with the extra stream times named (random)."""
    rows = [_ab_row(rng, shape, v) for v in ("ffi", "flashmla")]
    for row, keys in zip(rows, (ours, peer)):
        row.update({key: float(rng.uniform(10, 900)) for key in keys})
    return rows


def test_ab_and_command_buffer_sections(tmp_path):
    rng = np.random.default_rng()
    fp8 = [_ab_row(rng, "B64 H16 S4096 Q1 p64 fp8", v) for v in ("base", "cvt0")]
    pdl = [_ab_row(rng, "B1 H16 S1024 Q1 p64", v) for v in ("base", "pdl")]
    cb = [{"flag_set": f, "shape": "B1 H16 S1024 Q1 p64", "command_buffers": n,
           "stream_us": float(rng.uniform(10, 40)), "gpu_us": float(rng.uniform(10, 40)),
           "chain_span_us": float(rng.uniform(10, 40))} for f, n in (("default", 1), ("off", 0))]
    cb[0]["updates"] = {"updates": int(rng.integers(1, 9)), "executions": 9,
                        "update_us_mean": float(rng.uniform(100, 900))}
    for name, rows in (("ab_fp8.json", fp8), ("ab_pdl.json", pdl), ("cmdbuf.json", cb)):
        (tmp_path / name).write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    for title in ("## fp8 caches: tiles", "## Programmatic dependent launch",
                  "## Command buffers around the chain"):
        assert text.count(title) == 1, title
    assert "## Tuning A/B" not in text and "## fp8 verify" not in text  # no ab.json here
    for r in fp8 + pdl:
        assert (f"| {r['shape']} | {r['variant']} | {r['best_us']:.1f} | {r['vs_first']:.3f} | "
                f"{r['gpu_us']:.1f} |") in text, r
    for r in cb:
        assert (f"| {r['flag_set']} | {r['shape']} | {r['command_buffers']} | "
                f"{r['stream_us']:.1f} | {r['gpu_us']:.1f} | {r['chain_span_us']:.1f} |") in text
    up = cb[0]["updates"]
    assert f"| {up['updates']} / 9 | {up['update_us_mean']:.1f} |" in text
    assert text.count("| - | - |") == 1  # the row logged without updates
    # Sections in the order of report.AB_FILES, command buffers after them.
    assert text.index("## fp8 caches") < text.index("## Programmatic") < text.index(
        "## Command buffers around")


def test_ab_table_shows_the_donated_stream_time_where_measured():
    rng = np.random.default_rng()
    rows = [_ab_row(rng, "B8 H16 S4096 Q1 p64", v) for v in ("ffi", "flashmla")]
    assert "donated" not in report.ab_table(rows)
    rows[0]["donated_best_us"] = float(rng.uniform(10, 900))
    text = report.ab_table(rows)
    r, peer = rows
    assert (f"| {r['shape']} | ffi | {r['best_us']:.1f} | {r['donated_best_us']:.1f} | "
            f"{r['vs_first']:.3f} |") in text
    assert f"| {peer['shape']} | flashmla | {peer['best_us']:.1f} | - | " in text
    assert all(line.count("|") == 9 for line in text.splitlines())


def test_ab_table_shows_runs_in_flight_and_flashmla_by_our_clock():
    rng = np.random.default_rng()
    rows = r, peer = _ours_and_peer(rng, "B8 H16 S4096 Q1 p64", ["in_flight_best_us"],
                                    ["in_flight_best_us", "wall_best_us"])
    text = report.ab_table(rows)
    assert "runs in flight µs" in text and "our clock µs" in text
    assert (f"| {r['shape']} | ffi | {r['best_us']:.1f} | - | {r['in_flight_best_us']:.1f} | "
            f"{r['vs_first']:.3f} | {r['gpu_us']:.1f} | "
            f"{r['in_flight_best_us'] / r['gpu_us']:.3f} |") in text
    assert (f"| flashmla | {peer['best_us']:.1f} | {peer['wall_best_us']:.1f} | "
            f"{peer['in_flight_best_us']:.1f} | ") in text
    assert all(line.count("|") == 11 for line in text.splitlines())


def test_launcher_and_decode_tables_add_runs_in_flight_where_measured():
    rng = np.random.default_rng()
    assert "in flight" not in report.launcher_table(_ours_and_peer(rng, "B1 H16 S1024 Q1 p64"))
    rows = r, peer = _ours_and_peer(rng, "B1 H16 S1024 Q1 p64", ["in_flight_best_us"],
                                    ["in_flight_best_us", "wall_best_us"])
    text = report.launcher_table(rows)
    assert (f"| ffi | {r['best_us']:.1f} | - | {r['in_flight_best_us']:.1f} | "
            f"{r['gpu_us']:.1f} | {r['best_us'] / r['gpu_us']:.3f} | "
            f"{r['in_flight_best_us'] / r['gpu_us']:.3f} |") in text
    assert f"| flashmla | {peer['best_us']:.1f} | {peer['wall_best_us']:.1f} | " in text
    assert len({line.count("|") for line in text.splitlines()}) == 1
    row = {"shape": "B8 H16 S4096 Q1 p64", "backend": "triton", "us": 30.0, "gpu_us": 25.0,
           "in_flight_us": float(rng.uniform(20, 40)), "kv_TBps": 1.0, "TFLOPs": 10.0}
    data = {"environment": {}, "rows": [row, {"shape": "x", "backend": "xla", "error": "e"}]}
    text = report.decode_table(data)
    assert f"| triton | 30.0 | {row['in_flight_us']:.1f} | 25.0 |" in text
    assert len({line.count("|") for line in text.splitlines()[-4:]}) == 1
    del row["in_flight_us"]
    assert "in flight" not in report.decode_table(data)


def test_launcher_table_adds_the_back_to_back_calls_and_their_ratio():
    rng = np.random.default_rng()
    rows = r, peer = _ours_and_peer(rng, "B32 H16 S4096 Q1 p64",
                                    ["in_flight_best_us", "serial_best_us"], ["in_flight_best_us"])
    text = report.launcher_table(rows)
    assert "no feeding kernel µs" in text and "back to back / GPU" in text
    assert (f"| ffi | {r['best_us']:.1f} | {r['in_flight_best_us']:.1f} | "
            f"{r['serial_best_us']:.1f} | {r['gpu_us']:.1f} | {r['best_us'] / r['gpu_us']:.3f} | "
            f"{r['in_flight_best_us'] / r['gpu_us']:.3f} | "
            f"{r['serial_best_us'] / r['gpu_us']:.3f} |") in text
    # FlashMLA's graph has no back-to-back chain of ours: "-" there, its ratio too.
    assert (f"| flashmla | {peer['best_us']:.1f} | {peer['in_flight_best_us']:.1f} | - | "
            f"{peer['gpu_us']:.1f} | {peer['best_us'] / peer['gpu_us']:.3f} | "
            f"{peer['in_flight_best_us'] / peer['gpu_us']:.3f} | - |") in text
    assert len({line.count("|") for line in text.splitlines()}) == 1
    assert " run |" not in text
    # Rows gathered from several runs name theirs in a last column.
    r["run"] = "call 3"
    text = report.launcher_table(rows)
    assert text.splitlines()[0].endswith(" run |") and "| call 3 |" in text
    assert text.splitlines()[-1].endswith("| - |")
    assert len({line.count("|") for line in text.splitlines()}) == 1
    text = report.ab_table(rows)
    assert f"{r['serial_best_us'] / r['gpu_us']:.3f} |" in text
    assert len({line.count("|") for line in text.splitlines()}) == 1


def test_gaps_section_splits_our_kernels_from_the_timers(tmp_path):
    import json

    rng = np.random.default_rng()
    k = {n: float(rng.uniform(0.1, 30)) for n in ("mla_decode", "mla_reduce_affine",
                                                  "loop_dynamic_update_slice_fusion",
                                                  "Memcpy DtoD (Device -> Device)")}
    gaps = {n: float(rng.uniform(-0.1, 0.2)) for n in k}
    row = {"shape": "B8 H16 S4096 Q1 p64", "span_us": sum(k.values()) + sum(gaps.values()),
           "kernels_us": k, "gap_before_us": gaps, "launches": 4.0}
    ours = k["mla_decode"] + k["mla_reduce_affine"]
    back = {"shape": row["shape"], "chain": "serial", "launcher": "ffi", "span_us": ours,
            "launches": 2.0,
            "kernels_us": {n: k[n] for n in ("mla_decode", "mla_reduce_affine")},
            "gap_before_us": {}, "run_span_us": [float(x) for x in rng.uniform(10, 40, 3)],
            "between_runs_us": float(rng.uniform(1, 300))}
    (tmp_path / "gaps.json").write_text(json.dumps([row, back]))
    text = report.report(str(tmp_path))
    timer = sum(k.values()) - ours
    assert "## The timing chain on the GPU's timeline" in text
    # A row from before the chain was named is the fed chain, with no per-run spans.
    assert (f"| {row['shape']} | fed | - | {row['span_us']:.1f} | {ours:.1f} | {timer:.1f} | "
            f"{sum(gaps.values()):.1f} | {row['span_us'] - timer:.1f} | - | - |") in text
    spans = ", ".join(f"{x:.1f}" for x in back["run_span_us"])
    assert (f"| {row['shape']} | serial | ffi | {ours:.1f} | {ours:.1f} | 0.0 | 0.0 | "
            f"{ours:.1f} | "
            f"{spans} | {back['between_runs_us']:.1f} |") in text


def test_one_call_section_is_a_launcher_table(tmp_path):
    rng = np.random.default_rng()
    rows = [_ab_row(rng, "B8 H16 S4096 Q1 p64", v) for v in ("two", "one", "one_pdl")]
    for r in rows:
        r["serial_best_us"] = float(rng.uniform(10, 900))
        r["serial_in_flight_best_us"] = float(rng.uniform(10, 900))
    (tmp_path / "one_call_ab.json").write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    assert text.count("## The decode kernel and its reduce as one custom call") == 1
    assert "back to back in flight / GPU" in text
    for r in rows:
        g = r["gpu_us"]
        assert (f"| {r['shape']} | {r['variant']} | {r['best_us']:.1f} | "
                f"{r['serial_best_us']:.1f} | {r['serial_in_flight_best_us']:.1f} | {g:.1f} | "
                f"{r['best_us'] / g:.3f} | {r['serial_best_us'] / g:.3f} | "
                f"{r['serial_in_flight_best_us'] / g:.3f} |") in text, r


def test_empty_folder_has_no_sections(tmp_path):
    assert "## " not in report.report(str(tmp_path))


def test_chain_length_section(tmp_path):
    """``cmdbuf_chains_on.json`` and ``_off.json`` (and the older ``cmdbuf_chains.json``,
    whose rows do not say where our calls ran) give one table, wall minus span per row."""
    rng = np.random.default_rng()

    def row(n, inside=None, init=False, launcher=None):
        r = {"shape": "1,16,1024", "n": n, "wall_us": float(rng.uniform(20, 40)),
             "enqueue_us": float(rng.uniform(5, 20)), "span_us": float(rng.uniform(10, 15))}
        if inside is not None:
            r["ffi_command_buffers"] = inside
            r["ffi_initialize_stage"] = init
        if launcher is not None:
            r["launcher"] = launcher
        return r

    logged = {**row(32, True, init=True), "updates": {
        "executions": 7, "executions_since_update_max": 1, "updates": int(rng.integers(2, 7)),
        "first_records": 1, "stream_captures": int(rng.integers(3, 99))}}

    recorded = {**row(8, True, launcher="ffi_record"), "updates": {
        "executions": 7, "executions_since_update_max": 1, "updates": 6, "first_records": 1,
        "stream_captures": 0, "ffi_records": int(rng.integers(2, 99)),
        "update_us_mean": float(rng.uniform(100, 900))}}

    traced = {**row(64, True), "host_events_us": {"CommandBufferThunk::ExecuteOnStream":
                                                  float(rng.uniform(1, 9)), "cuLaunch": 0.5}}
    files = {"cmdbuf_chains.json": [row(4)], "cmdbuf_chains_on.json": [row(16, True), traced],
             "cmdbuf_chains_off.json": [row(128, False), {**row(1, False), "span_us": None}],
             "cmdbuf_chains_init.json": [logged], "cmdbuf_chains_record.json": [recorded]}
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    assert text.count("## Where a chained call's wall time goes") == 1
    for rows in files.values():
        for r in rows:
            inside = {None: "-", True: "yes", False: "no"}[r.get("ffi_command_buffers")] + (
                ", recorded" if r.get("launcher") == "ffi_record" else "") + (
                " + init" if r.get("ffi_initialize_stage") else "")
            span = r["span_us"]
            tail = (f"{span:.1f} | {r['wall_us'] - span:.1f} |" if span is not None
                    else "- | - |")
            assert (f"| {r['shape']} | {inside} | {r['n']} | {r['wall_us']:.1f} | "
                    f"{r['enqueue_us']:.1f} | {tail}") in text, r
    u = logged["updates"]
    assert (f"| {logged['wall_us'] - logged['span_us']:.1f} | {u['updates']} (1) | 1 | "
            f"{u['stream_captures']} | 0 | - |") in text
    u = recorded["updates"]
    assert (f"| 6 (1) | 1 | 0 | {u['ffi_records']} | {u['update_us_mean']:.0f} |") in text
    # the rows without a log
    assert sum(ln.endswith("| - | - | - | - | - |") for ln in text.splitlines()) == 5
    assert text.count("### The host's time a chained call") == 1
    for name, us in traced["host_events_us"].items():
        assert f"| 1,16,1024 | yes | 64 | `{name}` | {us:.2f} |" in text


def test_split_probe_section(tmp_path):
    """``split_probe.json``: a row per case, the split's error and low-part share, and each
    variant's error against its own answer, NaN rows named where there were any."""
    rng = np.random.default_rng()
    rows = []
    for case in ("B2 H64 S300 Q1 p64 fp8", "B2 H16 S2048 Q4 p16 fp8"):
        r = {"case": case, "split_rel_err": float(rng.uniform(0, 1e-6)),
             "lo_nonzero": float(rng.uniform(0.5, 1))}
        for name in ("real", "hi_zero"):
            r[name] = {"rel_err": float(rng.uniform(1e-3, 3e-3)), "nan_rows": 0}
        r["hi_zero_vs_zero_hi"] = 0.0
        rows.append(r)
    rows[1]["real"]["nan_rows"] = 3
    (tmp_path / "split_probe.json").write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    assert text.count("## The split-query kernel on made query parts") == 1
    assert "| case | split rel err | low part nonzero | real | hi_zero |" in text
    for r in rows:
        real = f"{r['real']['rel_err']:.1e}" + (" (3 NaN rows)" if r["real"]["nan_rows"] else "")
        assert (f"| {r['case']} | {r['split_rel_err']:.1e} | {r['lo_nonzero']:.3f} | {real} | "
                f"{r['hi_zero']['rel_err']:.1e} |") in text, r


def test_memcheck_section_names_every_case_and_try(tmp_path):
    rows = [{"test": "tests/test_bad_values.py::test_x[triton]", "result": "passed",
             "errors": 0, "tries": [{"rc": -11, "seconds": 3.2, "errors": None,
                                     "outcome": "signal"},
                                    {"rc": 0, "seconds": 9.6, "errors": 0,
                                     "outcome": "passed"}]},
            {"test": "tests/test_conformance.py::test_y", "result": "signal", "errors": None,
             "tries": [{"rc": -11, "seconds": 4.0, "errors": None, "outcome": "signal"}]},
            {"test": "tests/test_conformance.py::test_z", "result": "passed", "errors": 0,
             "tries": [{"call": "12th session", "rc": 0, "seconds": None, "errors": 0,
                        "outcome": "passed"},
                       {"call": 2, "rc": 139, "seconds": 3.6, "errors": None,
                        "outcome": "signal"}]}]
    (tmp_path / "memcheck.json").write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    assert "## compute-sanitizer memcheck" in text
    assert "| `test_bad_values.py::test_x[triton]` | passed | 0 | signal 3, passed 10 |" in text
    assert "| `test_conformance.py::test_y` | signal | - | signal 4 |" in text
    assert "| `test_conformance.py::test_z` | passed | 0 | 12th session: passed, 2: signal 4 |" \
        in text


def test_client_allocator_and_conformance_sections(tmp_path):
    """``client_ab.json`` is a launcher table; ``allocators.json`` one row per allocator, shape
    and chain length, with XLA's updates, and a failed client with its error;
    ``conformance_ffi.json`` the counts, every case that did not pass, the other runs."""
    rng = np.random.default_rng()
    shape = "B1 H128 S1024 Q1 p64"
    clients = [_ab_row(rng, shape, v) for v in ("default_client", "tfrt_client")]
    wall = float(rng.uniform(10, 40))
    updates = {"executions": 7, "updates": 6, "updated_allocs_mean": 2.0,
               "executions_since_update_max": 1, "update_us_mean": 2414.3}
    alloc = {"note": "made up", "rows": [
        {"client": "default", "shape": "1,128,1024", "n": 128, "wall_us": wall,
         "enqueue_us": 21.2, "updates": updates},
        {"client": "tfrt", "shape": "1,128,1024", "n": 128, "wall_us": 16.6, "enqueue_us": 1.2,
         "updates": {"executions": 7, "updates": 0}},
        {"client": "temp_color_jit", "error": "INTERNAL: No allocator found"}]}
    conf = {"note": "n", "summary": {"passed": 53, "failed": 1, "xfailed": 1}, "shards": 6,
            "wall_s": 120.7, "cases": [
                {"test": "t::test_a", "outcome": "passed"}, {"test": "t::test_b",
                                                             "outcome": "failed"},
                {"test": "t::test_c", "outcome": "xfailed"},
                {"test": "t::test_d", "outcome": "not run"}],
            "other_runs": [{"run": "call 2", "summary": {"passed": 55}, "failed": ["t::test_e"]}]}
    for name, data in (("client_ab.json", clients), ("allocators.json", alloc),
                       ("conformance_ffi.json", conf)):
        (tmp_path / name).write_text(json.dumps(data))
    text = report.report(str(tmp_path))
    assert "## The default PJRT client against its TFRT client" in text
    assert f"| {shape} | tfrt_client | {clients[1]['best_us']:.1f} |" in text
    assert f"| default | 1,128,1024 | 128 | {wall:.1f} | 21.2 | 6 / 7 | 2.0 | 1 | 2414 |" in text
    assert "| tfrt | 1,128,1024 | 128 | 16.6 | 1.2 | 0 / 7 | - | - | - |" in text
    assert "| temp_color_jit | - | - | failed: INTERNAL: No allocator found |" in text
    assert "1 failed, 53 passed, 1 xfailed (6 processes, 121 s)." in text
    assert "- failed: `t::test_b`" in text and "- not run: `t::test_d`" in text
    assert "`t::test_a`" not in text and "`t::test_c`" not in text
    assert "- call 2: passed: 55." in text and "  - failed: `t::test_e`" in text


def test_anatomy_section_cuts_each_run_and_lists_the_logged_chains(tmp_path):
    """``anatomy.json``: a row per variant, shape and chain length with the unprofiled wall and
    enqueue time a call, the profiled run cut at the GPU (before / span / busy / after) and
    XLA's update and graph launch before the GPU starts ("none" where no run updated); then
    the chains with the update log, and those timed with it off."""
    rng = np.random.default_rng()
    wall = float(rng.uniform(10, 40))
    row = {"call": 1, "variant": "tfrt", "shape": "1,128,1024", "n": 128,
           "unprofiled_per_call_us": {"wall_us": wall, "enqueue_us": 1.16},
           "profiled_per_call_us": {"before_us": 18.9, "span_us": 14.3, "busy_us": 13.5,
                                    "after_us": 2.26},
           "before_events_run_us": {"command_buffer::update": 3042.7, "cuGraphLaunch": 904.7},
           "runs_with_event": {"command_buffer::update": 3, "cuGraphLaunch": 5}}
    quiet = {**row, "variant": "no_graphs", "before_events_run_us": {}, "runs_with_event": {}}
    logged = {"call": 4, "process": "tfrt_log", "shape": "1,16,64", "n": 128, "log": True,
              "wall_us": 23.5, "enqueue_us": 1.2,
              "updates": {"executions": 7, "updates": 3, "commands_updated_mean": 33.75,
                          "stream_captures": 512}}
    off = {**logged, "process": "tfrt", "log": False, "wall_us": 12.8}
    (tmp_path / "anatomy.json").write_text(json.dumps(
        {"note": "made up", "rows": [row, quiet], "chains": [logged, off]}))
    text = report.report(str(tmp_path))
    assert "## Where a waited run of the stream timer's chain goes" in text
    assert (f"| 1 | tfrt | 1,128,1024 | 128 | {wall:.1f} / 1.2 | 18.9 / 14.3 / 13.5 / 2.3 | "
            "3043 (3), 905 |") in text
    assert "| 1 | no_graphs | 1,128,1024 | 128 |" in text and "| none, - |" in text
    assert "| tfrt_log | 1,16,64 | 128 | 23.5 / 1.2 | 3 / 7 | 34 | 512 |" in text
    assert "| tfrt | 1,16,64 | 128 | 12.8 / 1.2 | log off | - | - |" in text
