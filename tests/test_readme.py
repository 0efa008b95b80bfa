"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- test: {name} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, f"README has no example marked {name}"
    return match.group(1)


@pytest.mark.parametrize("name", ["training-api"])
def test_readme_example_runs(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(example(name), f"README.md ({name})", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in lines if line.startswith("loss ")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
