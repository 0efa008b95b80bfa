"""The tree is formatted and linted as pyproject.toml's [tool.ruff] says (`ruff format`, `ruff check`)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.parametrize("command", [["format", "--check", "--diff"], ["check"]])
def test_ruff(command):
    assert RUFF, "ruff is a dev dependency: pip install -e '.[dev]'"
    out = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
