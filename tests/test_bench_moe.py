"""scripts/bench_moe.py at toy sizes: every backend and routing gets a row with positive times and
ratios, the capacity baseline's dropped rows match a count made here, the references get their rows
(the equal-groups loops and the FFN without experts, which the script checks against tiled's outputs
and gradients; BLAS on exact groups with every routing), the MXFP8 report is there, and the run says
on how many CPUs it ran (--cpus) and under what load."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_bench_moe_small(tmp_path):
    out = tmp_path / "bench_moe.json"
    args = [
        "--tokens",
        "512",
        "--hidden",
        "32",
        "--width",
        "16",
        "--experts",
        "8",
        "--repeats",
        "1",
        "--backends",
        "tiled,tiled16/4,ragged_dot,capacity",
        "--routings",
        "balanced,dirichlet0.3,one_takes_half,balanced_plus8",
        "--cpus",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_moe.py"), *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = {(r["routing"], r["backend"]): r for r in result["rows"]}
    routings = ("balanced", "dirichlet0.3", "one_takes_half", "balanced_plus8")
    references = {(name, "BLAS per group, GEMMs only (vs BLAS dense)") for name in routings} | {
        ("balanced", "loop, one pass"),  # these checked against tiled's outputs and gradients
        ("balanced", "loop, fwd then bwd"),
        ("balanced", "dense FFN, no experts"),
    }
    assert (
        set(rows) == {(a, b) for a in routings for b in ("tiled", "tiled16/4", "ragged_dot", "capacity")} | references
    )
    for key, r in rows.items():
        assert r["fwdbwd_s"] > 0 and r["fwdbwd_vs_dense"] > 0
        if key == ("balanced", "loop, one pass"):  # its forward is the other reference's: timed once
            assert r["fwd_s"] is None and r["fwd_vs_dense"] is None
        else:
            assert r["fwd_s"] > 0 and r["fwd_vs_dense"] > 0
    for name in routings:
        sizes = np.array(rows[(name, "capacity")]["group_sizes"])
        assert sizes.sum() == 512 and len(sizes) == 8
        assert rows[(name, "capacity")]["dropped_rows"] == np.maximum(sizes - 80, 0).sum()  # 80 = 1.25 x 512 / 8 slots
    assert (
        rows[("balanced", "capacity")]["dropped_rows"] == 0 and rows[("one_takes_half", "capacity")]["dropped_rows"] > 0
    )
    assert np.array(rows[("one_takes_half", "tiled")]["group_sizes"])[0] >= 256  # half the rows, plus rounding
    assert rows[("balanced_plus8", "tiled")]["group_sizes"] == [72, 56] * 4  # 64 rows a group, 8 moved
    assert set(result["mxfp8_logits"]) == {"mxfp8_vs_bf16", "bf16_vs_f32", "mxfp8_vs_f32"}
    machine = result["machine"]
    assert machine["cpus"] == 1 and machine["load_avg_before"] >= 0 and machine["load_avg_after"] >= 0
    assert "CPUs: 1, load average" in proc.stdout
