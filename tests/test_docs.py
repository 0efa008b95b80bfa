"""README.md and docs/*.md stay true to the tree: every relative link (and #anchor) resolves, every
docs page is linked from the README, every `moe-jax ...` command names a subcommand and flags its
parser has (and train/plan overrides name config keys), every `scripts/X.py ...` command only flags
that script defines, the training config reference is the one generated from the dataclasses, and
the README stays under 300 lines. The checks run on the text (no subprocess), and are themselves
tested on a broken link, a bogus flag and an unknown key."""

import argparse
import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from moe_jax.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 300

FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
FLAG = re.compile(r"(?<![\w./=-])--?[A-Za-z][\w-]*")
OVERRIDE = re.compile(r"^\[?([A-Za-z_][\w.]*)=")
PLACEHOLDER_KEYS = {"key", "section.key"}  # a synopsis's `[key=value ...]`


# ---- reading markdown ------------------------------------------------------------------------------
def split_fences(text: str) -> tuple[str, list[str]]:
    """(the text with fenced blocks blanked, the blocks' contents). Lines are kept, so the text's
    line numbers stay those of the file."""
    prose, blocks, block, fence = [], [], [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence, block = m.group(1), []
            prose.append("")
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            blocks.append("\n".join(block))
            fence = None
            prose.append("")
        elif fence is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
    return [m.group(2) for m in INLINE.finditer(prose)]


def code_texts(text: str) -> tuple[list[str], list[str]]:
    """(fenced blocks, inline code spans) of a markdown text."""
    prose, blocks = split_fences(text)
    return blocks, inline_code(prose)


def links(text: str) -> list[str]:
    """Link targets outside code: inline links, images and reference definitions."""
    prose, _ = split_fences(text)
    prose = INLINE.sub(lambda m: " " * len(m.group(0)), prose)
    return [m.group(1) for m in LINK.finditer(prose)] + REF_LINK.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, spaces -> -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    errors = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text):
                errors.append(f"{page.relative_to(ROOT)}: link to {target}: no such heading here")
            continue
        dest = (page.parent / path).resolve()
        if not dest.exists():
            errors.append(f"{page.relative_to(ROOT)}: link to {target}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            errors.append(f"{page.relative_to(ROOT)}: link to {target}: {dest.name} has no heading #{anchor}")
    return errors


# ---- commands --------------------------------------------------------------------------------------
def commands(code: str, fenced: bool, name: str) -> list[tuple[str, str]]:
    """(the name matched, the rest) of each command in a piece of code whose program matches the
    regex `name`. In a fenced block: backslash continuations joined, comments dropped, ended by |,
    &&, ; or a newline; in an inline span (a synopsis, where | separates choices): the rest of the
    span, up to && or ;."""
    if fenced:
        code = re.sub(r"\\\n", " ", code)
        pieces = []
        for line in code.split("\n"):
            line = re.sub(r"(^|\s)#.*", "", line)
            pieces += re.split(r"\s(?:\|\|?|&&|;)\s", line)
    else:
        pieces = re.split(r"\s(?:&&|;)\s", code)
    found = []
    for piece in pieces:
        for m in re.finditer(rf"(?:^|(?<=[\s/]))({name})(?=\s|$)", piece):
            found.append((m.group(1), piece[m.end(1) :]))
    return found


@cache
def cli_parsers() -> tuple[set[str], dict[str, set[str]]]:
    """(the top-level options, {subcommand: its options}) of `moe-jax`, from cli.build_parser()."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = lambda p: {s for a in p._actions for s in a.option_strings}  # noqa: E731
    return options(parser), {name: options(p) for name, p in subs.choices.items()}


@cache
def script_flags(script: str) -> frozenset[str] | None:
    """The flags scripts/SCRIPT.py defines (its add_argument calls, and those of
    moe_jax.measure.benchmark_parser when it uses it); None if there is no such script."""
    path = ROOT / "scripts" / script
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    flags = {"-h", "--help"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
        elif func == "benchmark_parser":
            shared = script_flags_of_function(ROOT / "moe_jax" / "measure.py", "benchmark_parser")
            workdir = any(k.arg == "workdir" and getattr(k.value, "value", False) for k in node.keywords)
            flags |= shared if workdir else shared - {"--workdir"}
    return frozenset(flags)


def script_flags_of_function(path: Path, function: str) -> set[str]:
    tree = ast.parse(path.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {
        a.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
        for a in n.args
        if isinstance(a, ast.Constant) and str(a.value).startswith("-")
    }


@cache
def config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def config_keys() -> frozenset[str]:
    """Every key a train/plan override may set: the leaves, and the sections."""
    leaves = {key for key, *_ in config_reference().rows()}
    return frozenset(leaves | {key.rsplit(".", 1)[0] for key in leaves})


def command_errors(where: str, text: str) -> list[str]:
    """What is wrong with the moe-jax and scripts/*.py commands of a markdown text."""
    top, subs = cli_parsers()
    errors = []
    fenced, inline = code_texts(text)
    for code, is_fenced in [(c, True) for c in fenced] + [(c, False) for c in inline]:
        for _, rest in commands(code, is_fenced, "moe-jax"):
            cmd = f"moe-jax{rest}".strip()[:80]
            words = rest.split()
            sub = words[0] if words else ""
            if sub.startswith("-"):  # `moe-jax --help`
                allowed, args = top, rest
            elif re.fullmatch(r"[a-z][a-z-]*", sub):
                if sub not in subs:
                    errors.append(f"{where}: `{cmd}`: moe-jax has no subcommand {sub!r}")
                    continue
                allowed, args = subs[sub], " ".join(words[1:])
            else:
                continue  # `moe-jax`'s name in prose (e.g. "moe-jax's"), not a command
            errors += [
                f"{where}: `{cmd}`: `moe-jax {sub}` has no flag {f}" for f in FLAG.findall(args) if f not in allowed
            ]
            if sub in ("train", "plan"):
                for word in args.split():
                    m = OVERRIDE.match(word)
                    if m and m.group(1) not in PLACEHOLDER_KEYS and m.group(1) not in config_keys():
                        errors.append(f"{where}: `{cmd}`: {m.group(1)} is not a training config key")
        for path, rest in commands(code, is_fenced, r"scripts/[\w-]+\.py"):
            flags = script_flags(path.removeprefix("scripts/"))
            if flags is None:
                errors.append(f"{where}: {path} does not exist")
                continue
            errors += [f"{where}: `{path}` has no flag {f}" for f in FLAG.findall(rest) if f not in flags]
    return errors


# ---- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    errors = broken_links(page)
    assert not errors, "\n".join(errors)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README.read_text()) if not re.match(r"\w+:", t)}
    missing = [p.relative_to(ROOT).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_name_real_subcommands_flags_and_keys(page):
    errors = command_errors(page.relative_to(ROOT).as_posix(), page.read_text())
    assert not errors, "\n".join(errors)


def test_readme_commands_table_lists_every_command_and_flag():
    """The README's table of commands gives each subcommand's whole synopsis: every flag it has."""
    _, subs = cli_parsers()
    rows = re.findall(r"^\| `moe-jax ([a-z-]+)(.*?)` \|", README.read_text(), re.M)
    assert sorted(name for name, _ in rows) == sorted(subs), "one row per subcommand"
    for name, synopsis in rows:
        missing = subs[name] - {"-h", "--help"} - set(FLAG.findall(synopsis))
        assert not missing, f"README's `moe-jax {name}` row lacks {', '.join(sorted(missing))}"


def test_readme_is_at_most_300_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move detail to docs/)"


def test_readme_starts_with_setup_and_the_test_command():
    """The first screen: the two commands (CI runs the test command the README gives)."""
    first = "\n".join(README.read_text().split("\n")[:40])
    assert "bash scripts/setup.sh && .venv/bin/moe-jax quickstart" in first
    assert ".venv/bin/python -m pytest -q tests" in first
    assert (ROOT / ".ci" / "run").read_text().count(".venv/bin/python -m pytest -q tests") == 1


def test_config_reference_is_generated_from_the_dataclasses():
    ref = config_reference()
    doc = (ROOT / "docs" / "training.md").read_text()
    assert ref.current(doc) == ref.reference(), (
        "docs/training.md's config reference differs from moe_jax/train/config.py: "
        "run .venv/bin/python scripts/config_reference.py --write"
    )


# ---- the checks catch what they are for -------------------------------------------------------------
def test_the_checks_catch_a_broken_link_anchor_flag_subcommand_and_key():
    page = ROOT / "docs" / "page.md"
    text = "\n".join(
        [
            "# Page",
            "[ok](training.md) [ok](../README.md#moe-jax) [ok](#page) [web](https://example.com/x)",
            "[gone](missing.md) [no heading](training.md#no-such-heading)",
            "`[not a link](missing.md)`",
            "```bash",
            "[also not a link](missing.md)",
            "moe-jax convert --from hf org/name --to out --bogus  # --commented-out",
            "moe-jax frobnicate --x",
            ".venv/bin/moe-jax train --config run.yaml optim.lr=1e-3 optim.nope=1 \\",
            "    --resum",
            ".venv/bin/python scripts/bench_moe.py --out x.json --no-such-flag",
            "```",
            "`moe-jax plot RUN [--out P.png \\| --outt]` and `moe-jax export --from A --to B --dtype fp8`",
        ]
    )
    assert broken_links(page, text) == [
        "docs/page.md: link to missing.md: missing.md does not exist",
        "docs/page.md: link to training.md#no-such-heading: training.md has no heading #no-such-heading",
    ]
    errors = command_errors("page", text)
    assert [e.split(": ")[-1] for e in errors] == [
        "`moe-jax convert` has no flag --bogus",
        "moe-jax has no subcommand 'frobnicate'",
        "`moe-jax train` has no flag --resum",
        "optim.nope is not a training config key",
        "`scripts/bench_moe.py` has no flag --no-such-flag",
        "`moe-jax plot` has no flag --outt",
    ], errors
