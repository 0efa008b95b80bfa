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


# The modules that join the layers: commands and from_pretrained read and write checkpoints.
JOINS_CONVERTERS = {"cli.py", "quickstart.py", "pretrained.py", "train/loop.py"}


def test_core_does_not_import_converters():
    """moe_jax's core (model, data, sharding, files, kernels, ...) stands below the converters."""
    import ast

    offenders = []
    for path in sorted((ROOT / "moe_jax").rglob("*.py")):
        rel = path.relative_to(ROOT / "moe_jax").as_posix()
        if rel in JOINS_CONVERTERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"moe_jax/{rel}: imports {n}" for n in names if n.split(".")[0] == "converters"]
    assert not offenders, "\n".join(offenders)
