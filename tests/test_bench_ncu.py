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
