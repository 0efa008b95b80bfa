"""What the conversion and validation benchmarks stand on, at toy size: `moe_jax.measure` sees a
child's private memory and its exit status; the benchmark scripts call the library (no path
edits, no imports of each other, DeepSeek-V3's widths only from `moe_jax.config.DEEPSEEK_V3`)."""

import ast
import os
import sys
from pathlib import Path

import pytest

from moe_jax.measure import GiB, read_rss, run_sampled

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ["bench_convert.py", "bench_validate.py", "bench_train.py", "bench_parity.py"]

HOLD = "import sys, time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5); print('done'); sys.exit({})"


def test_run_sampled_sees_private_memory_and_output():
    run = run_sampled([sys.executable, "-c", HOLD.format(0)])
    assert run["returncode"] == 0 and run["stdout"] == "done\n"
    assert 300 * 2**20 <= run["peak_anon"] < 2 * GiB and run["peak_file"] > 0
    assert run["seconds"] >= 0.5


def test_run_sampled_exit_status():
    assert run_sampled([sys.executable, "-c", HOLD.format(1)], check=False)["returncode"] == 1  # a failed check
    with pytest.raises(RuntimeError, match="failed"):
        run_sampled([sys.executable, "-c", HOLD.format(1)])
    with pytest.raises(RuntimeError, match="failed"):
        run_sampled([sys.executable, "-c", HOLD.format(2)], check=False)  # bad input is not a measurement


def test_read_rss_of_self_and_of_nothing():
    me = read_rss(os.getpid())
    assert me["anon"] > 0 and me["file"] > 0
    assert read_rss(2**22 + 12345) == {}  # above pid_max: no such process


@pytest.mark.parametrize("script", BENCHES)
def test_benchmarks_call_the_library(script):
    tree = ast.parse((ROOT / "scripts" / script).read_text())
    others = {Path(s).stem for s in (ROOT / "scripts").glob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            raise AssertionError(f"{script}:{node.lineno} touches sys.path")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not {n.split(".")[0] for n in names} & others, f"{script}:{node.lineno} imports another script"
        if isinstance(node, ast.Constant) and node.value in (7168, 18432, 129280):
            raise AssertionError(f"{script}:{node.lineno}: DeepSeek-V3's {node.value} belongs in moe_jax.config")
