"""The shape of the code: layers that import one way, no cycles, imports at the top of files.

Layers, lowest first (docs/architecture.md): the core (model, MoE, kernels, quantization,
parallelism, sharding, the parameter table) imports nothing above it; the converters stand on the
core; validation on both; the application (CLI, training, `from_pretrained`) on top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_jax", "converters", "validation")
LAYERS = ("core", "converters", "validation", "application")
APPLICATION = (
    "moe_jax.cli",
    "moe_jax.pretrained",
    "moe_jax.quickstart",
    "moe_jax.data",
    "moe_jax.measure",
    "moe_jax.train",
)
# imported where used: optional or heavy (seconds to import) and needed by few paths; the Mosaic GPU
# kernels run only on (or compiled for) a GPU and cost every process 0.4 s to import. The modules
# that import torch are lazy where a path may not need them: `moe-jax train` imports no torch (2.5 s)
# unless it validates its start or writes TensorBoard logs.
LAZY_ALLOWED = (
    "torch",
    "transformers",
    "compressed_tensors",  # imports transformers
    "transformer_engine",
    "transformer_engine_jax",
    "jax.experimental.pallas.ops.gpu",
    "tensorboardX",  # imports torch when it is installed
    "converters.torch_interop",
    "validation.layerwise",
)
DISPATCH = "moe_jax.cli"  # imports each command's code when the command runs (a fast --help)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def layer(module: str) -> str:
    if module == "moe_jax" or any(module == a or module.startswith(a + ".") for a in APPLICATION):
        return "application"  # the package itself: its public names come from every layer
    return {"moe_jax": "core", "converters": "converters", "validation": "validation"}[module.split(".")[0]]


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function or class) for every import statement."""
    tree = ast.parse(path.read_text())
    nested = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for n in ast.walk(f)
        if n is not f
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        else:
            continue
        out += [(t, node.lineno, id(node) in nested) for t in targets]
    return out


def local_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for m, path in known.items():
        for target, _, _ in imports(path, known):
            while target and target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != m:
                graph[m].add(target)
    if "moe_jax" in graph:  # the package's public names, resolved on first use
        sys.path.insert(0, str(ROOT))
        import moe_jax

        graph["moe_jax"] |= set(moe_jax.PUBLIC.values())
    return graph


def test_every_module_has_a_layer():
    for m in modules():
        assert layer(m) in LAYERS


def test_layers_import_downward_only():
    graph = local_graph()
    wrong = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in graph.items()
        for t in sorted(targets)
        if LAYERS.index(layer(t)) > LAYERS.index(layer(m))
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = local_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles  # (between layers, test_layers_import_downward_only rules them out)


def test_imports_at_top_of_files():
    known = modules()
    inside = [
        f"{path.relative_to(ROOT)}:{line}: import {target}"
        for m, path in known.items()
        if m != DISPATCH
        for target, line, nested in imports(path, known)
        if nested and not any(target == a or target.startswith(a + ".") for a in LAZY_ALLOWED)
    ]
    assert not inside, "\n".join(dict.fromkeys(inside))


def test_cli_starts_without_jax():
    code = "import sys, moe_jax, moe_jax.cli; print(sorted(m for m in ('jax', 'torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
