"""The training config reference in docs/training.md, generated from the config dataclasses.

Every key of `moe_jax.train.config.TrainConfig` (its sections as `section.key`), with its type
and default as the dataclasses declare them and the comment beside the field in
moe_jax/train/config.py as its description. `tests/test_docs.py` checks that docs/training.md
holds exactly this text, so the reference cannot drift from the code: after changing a field,

    .venv/bin/python scripts/config_reference.py --write     # rewrites the block in docs/training.md
    .venv/bin/python scripts/config_reference.py             # prints it
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SOURCE = ROOT / "moe_jax" / "train" / "config.py"
DOC = ROOT / "docs" / "training.md"
BEGIN = (
    "<!-- BEGIN config reference: generated from moe_jax/train/config.py by scripts/config_reference.py "
    "(run it with --write after changing a field); tests/test_docs.py checks it -->"
)
END = "<!-- END config reference -->"


def field_comments(source: str) -> dict[str, str]:
    """`Class.field` -> the comment(s) on the lines of its declaration, for every class."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    lines = range(stmt.lineno, stmt.end_lineno + 1)
                    text = " ".join(comments[n] for n in lines if n in comments)
                    out[f"{node.name}.{stmt.target.id}"] = text
    return out


def type_name(hint) -> str:
    if hint is typing.Any:
        return "any"
    args = typing.get_args(hint)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return hint.__name__


def default_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf of TrainConfig, in declaration order."""
    from moe_jax.train.config import TrainConfig

    comments = field_comments(SOURCE.read_text())
    out = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        instance = cls()
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), f"{prefix}{f.name}.")
                continue
            key = prefix + f.name
            what = comments.get(f"{cls.__name__}.{f.name}")
            if not what:
                raise SystemExit(f"{SOURCE}: {key} has no comment to describe it")
            out.append((key, type_name(hints[f.name]), default_text(value), what))

    walk(TrainConfig, "")
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    """The block docs/training.md holds, markers included."""
    lines = [
        BEGIN,
        "",
        "| key | type | default | what |",
        "|---|---|---|---|",
    ]
    for key, kind, default, what in rows():
        lines.append(f"| `{key}` | {cell(kind)} | `{cell(default)}` | {cell(what)} |")
    lines += ["", END]
    return "\n".join(lines)


def current(doc: str) -> str | None:
    """The block as docs/training.md holds it now (None if it has none)."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        return None
    return doc[start : end + len(END)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the block in docs/training.md")
    args = ap.parse_args()
    text = reference()
    if not args.write:
        print(text)
        return 0
    doc = DOC.read_text()
    old = current(doc)
    if old is None:
        raise SystemExit(f"{DOC}: no block between {BEGIN!r} and {END!r} to replace")
    DOC.write_text(doc.replace(old, text))
    print(f"wrote the config reference ({len(rows())} keys) into {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
