"""``jax_mla.bench.ncu``: Nsight Compute's raw CSV read into per-kernel figures (no GPU here;
the CSV is written as ``ncu --import R --csv --page raw`` writes it: names, units, a row a
kernel, numbers with thousands separators)."""

import numpy as np

from jax_mla.bench import ncu


def _csv(rows):
    return "\n".join(",".join(f'"{v}"' for v in row) for row in rows)


def test_raw_csv_gives_durations_throughputs_and_stalls_largest_first():
    rng = np.random.default_rng()
    us, dram, tensor, lg, bar = (float(x) for x in rng.uniform(1, 90, 5))
    header = ["ID", "Kernel Name", "gpu__time_duration.sum",
              "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
              "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
              "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio",
              "launch__registers_per_thread"]
    units = ["", "", "msecond", "%", "Mbyte", "%", "%", "inst", "inst", "inst", "register/thread"]
    row = ["0", "mla_decode_sm90_kernel", f"{us / 1e3:.6f}", f"{dram:.2f}", "1,234.5",
           f"{tensor:.2f}", "0.5", f"{lg:.3f}", f"{bar:.3f}", "0", "168"]
    text = "==PROF== Disconnected\n" + _csv([header, units, row])
    [k] = ncu.parse_raw_csv(text)
    assert k["kernel"] == "mla_decode_sm90_kernel"
    assert abs(k["us"] - us) < 1e-3 and abs(k["dram_pct"] - dram) < 1e-2
    assert k["dram_read_bytes"] == 1234.5e6 and k["registers"] == 168
    assert abs(k["tensor_pct"] - max(tensor, 0.5)) < 1e-2 and len(k["tensor_pipes"]) == 2
    assert list(k["stalls"]) == sorted(["long_scoreboard", "barrier"],
                                       key=lambda n: -{"long_scoreboard": lg, "barrier": bar}[n])


def test_no_kernels_when_nothing_was_profiled():
    assert ncu.parse_raw_csv("==PROF== Disconnected from process 1\n") == []


def test_cases_are_split_into_ours_and_peers():
    ours = [c for c in ncu.DEFAULT_CASES if c.split(":")[0] in ncu.OURS]
    assert ours and len(ours) < len(ncu.DEFAULT_CASES)
    assert all(c.split(":")[0] in ("jax_mla", "prefill", "flashmla", "cudnn")
               for c in ncu.DEFAULT_CASES)


def test_report_shows_each_case_with_xla_kernels_summed(tmp_path):
    import json

    from jax_mla.bench import report

    rng = np.random.default_rng()
    us = [float(x) for x in rng.uniform(1, 9, 3)]
    rows = [{"case": "jax_mla:8,16,4096", "rc": 0, "kernels": [
        {"kernel": "loop_convert_fusion", "us": us[0], "stalls": {}},
        {"kernel": "input_reduce_fusion", "us": us[1], "stalls": {}},
        {"kernel": "mla_reduce_affine_kernel", "us": us[2], "stalls": {}},
        {"kernel": "void sm90::flash<T, 3>(x)", "us": 250.0, "sm_pct": 61.2, "tensor_pct": 64.6,
         "dram_read_bytes": 2.5e8, "registers": 240, "stalls": {"long_scoreboard": 3.5,
                                                                 "barrier": 1.4}}]},
            {"case": "cudnn:1,16,8192", "rc": -1, "kernels": []}]
    (tmp_path / "ncu.json").write_text(json.dumps(rows))
    text = report.report(str(tmp_path))
    assert "## Nsight Compute: our kernels" in text
    assert f"| 2 XLA kernels under 10 µs | {us[0] + us[1]:.1f} |" in text
    assert "| mla_reduce_affine_kernel |" in text  # ours are listed however short
    assert "| sm90::flash | 250.0 | 61.2 | 64.6 | - | 250.0 | 240 |" in text
    assert "long_scoreboard 3.50, barrier 1.40" in text
    assert "(nothing profiled: rc -1)" in text
