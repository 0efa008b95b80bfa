"""scripts/bench_ep.py --quick: dispatch rows equal the distinct-rank lower bound and come within 10%
of the analytic count for balanced routing, node-limited routing keeps tokens on at most 4 of 8 ranks,
the worst routing's load and rounds, and the step-time runs on 1 and 8 CPU devices complete."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_ep.py"


def test_bench_ep_quick(tmp_path):
    out = tmp_path / "bench_ep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    regimes = {g["name"]: g for g in result["regimes"]}
    assert set(regimes) == {"uniform", "zipf", "worst", "uniform_nolimit", "zipf_nolimit"}
    for g in regimes.values():
        assert [s["ep"] for s in g["ep"]] == [8, 16, 32, 64]
        for s in g["ep"]:
            rows = s["rows_total"]
            assert rows["dedup"] == rows["lower_bound"] and s["dedup_equals_lower_bound"]
            assert rows["dedup"] <= rows["naive"] == s["tokens"] * 8
            assert s["reduction_naive_over_dedup"] >= 1
            assert s["remote_rows_per_token"]["dedup"] == s["remote_rows_per_token"]["lower_bound"]
            assert s["dispatch_hidden_bytes_per_token"]["dedup"] == s["dispatch_hidden_bytes_per_token"]["lower_bound"]
    for name in ("uniform", "zipf"):  # topk_group 4 of 8 groups; at EP=8 one group is one rank
        ep8 = regimes[name]["ep"][0]
        assert regimes[name]["topk_group"] == 4 and ep8["ranks_per_token_max"] <= 4
    assert regimes["uniform_nolimit"]["ep"][0]["ranks_per_token_max"] > 4  # without the limit, more ranks
    for name in ("uniform", "zipf", "uniform_nolimit", "zipf_nolimit"):  # rows sent vs the analytic count
        assert all(abs(s["measured_over_analytic"] - 1) < 0.1 for s in regimes[name]["ep"]), name
    worst = regimes["worst"]["ep"][0]  # every token on one rank of 8: 8x its balanced load
    assert worst["rank_pairs_max_over_mean"] == 8 and worst["further_rounds"]["1.25"] == 6
    steps = result["step_time"]["rows"]
    assert [r["devices"] for r in steps] == [1, 8]
    assert all(r["step_s"] > 0 for r in steps)
    assert all(r["max_abs_grad_diff_vs_first"] is None or r["max_abs_grad_diff_vs_first"] < 1e-5 for r in steps)
