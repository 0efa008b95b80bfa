"""Reading compiled HLO text: which computation runs how often (loop bodies times their trip
count), the collectives a program runs (bytes, groups, NVLink or network), and what its kernels
compute and move (matmul FLOPs, bytes read and written). XLA's own cost analysis counts a loop
body once; a model whose layers are a scan needs the counts below. For `moe-jax plan`."""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start|-done)?\(")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_DONE_OF = re.compile(r"-done\(%?([\w.\-]+)")
_SHAPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# The expert-parallel exchange's further rounds (moe_jax.parallel.ep): a while loop whose trip count
# the routing decides at run time, zero in the common case (Routing.overflow counts them in training).
_FURTHER_ROUNDS = re.compile(r'op_name="[^"]*ep_further_rounds/while"')


def trip_count(attrs: str, further_rounds: int = 0) -> int:
    """How often a while loop's body runs: its known trip count; `further_rounds` for the
    expert-parallel exchange's overflow loop; once for any other loop of unknown count."""
    if m := _TRIP.search(attrs):
        return int(m.group(1))
    return further_rounds if _FURTHER_ROUNDS.search(attrs) else 1


_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# jax 0.10's partitioner also writes groups as a mesh of the devices (in order) and the axes a group
# spans: replica_groups=mesh['axis_0'=16,'axis_1'=1] {'axis_0'}
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def array_bytes(text: str) -> list[int]:
    """Bytes of each array shape in `text`, e.g. "(f32[16]{0}, bf16[4,8]{1,0})" -> [64, 64]."""
    sizes = []
    for dtype, dims in _SHAPE.findall(text):
        bits = 8 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype))
        sizes.append(math.prod(int(d) for d in dims.split(",") if d) * bits // 8)
    return sizes


def replica_groups(line: str) -> list[list[int]] | None:
    if m := _GROUPS_IOTA.search(line):
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")]
        )
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    if m := _GROUPS_MESH.search(line):
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        spanned = re.findall(r"'([^']+)'", m.group(2))
        ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
        order = [i for i, (name, _) in enumerate(axes) if name not in spanned]
        order += [i for i, (name, _) in enumerate(axes) if name in spanned]
        size = math.prod(s for name, s in axes if name in spanned)
        return ids.transpose(order).reshape(-1, size).tolist()
    if m := _GROUPS_LIST.search(line):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := _PAIRS.search(line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


class Module(NamedTuple):
    computations: dict[str, list[str]]  # name -> its instruction lines
    entry: str


def parse(hlo: str) -> Module:
    """The computations of an HLO module's text and the name of its entry."""
    comps: dict[str, list[str]] = {}
    name = entry = None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            name = m.group(1)
            comps[name] = []
            entry = name if line.startswith("ENTRY") else entry
        elif name is not None:
            comps[name].append(line)
    return Module(comps, entry)


def executions(module: Module, further_rounds: int = 0) -> dict[str, int]:
    """How many times each computation runs in one execution of the entry (a while body:
    `trip_count` times; a conditional's branches: each counted as taken)."""
    comps, counts = module.computations, collections.Counter()

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in comps or depth > 64:
            return
        counts[name] += times
        for line in comps[name]:
            if "-done(" in line:  # an async pair names its computation twice; it runs once
                continue
            trip = trip_count(line, further_rounds)
            for kind, callee in _CALLEE.findall(line):
                visit(callee, times * (trip if kind == "body" else 1), depth + 1)
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    visit(callee, times, depth + 1)

    visit(module.entry, 1)
    return counts


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier"}  # fmt: skip


def _dims(type_text: str) -> list[int]:
    m = _SHAPE.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def fused_traffic(body: list[str], sizes: list[int], written: int) -> tuple[list[int], int]:
    """(bytes read of each operand, bytes written) of a fusion with computation `body`: an operand
    the fusion only slices is read as its slices; a fusion whose root updates a slice of an
    operand in place writes (and reads) only the update."""
    params, users, result_of, root = {}, collections.defaultdict(list), {}, None
    for line in body:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result, op, operands = m.group(1), m.group(2), m.group(3), re.findall(r"%?([\w.\-]+)", m.group(4))
        result_of[name] = (op, sum(array_bytes(result)), operands)
        if op == "parameter":
            params[int(m.group(4))] = name
        for o in operands:
            users[o].append(name)
        if line.lstrip().startswith("ROOT"):
            root = name
    reads = list(sizes)
    for i, name in params.items():
        uses = [result_of[u] for u in users[name]]
        if (
            i < len(reads)
            and uses
            and all(op in ("dynamic-slice", "gather", "slice") and ops[0] == name for op, _, ops in uses)
        ):
            reads[i] = sum(size for _, size, _ in uses)  # only sliced (as the operand, not an index)
    if root is not None and result_of[root][0] in ("dynamic-update-slice", "scatter"):
        op, _, operands = result_of[root]
        update = operands[1 if op == "dynamic-update-slice" else 2] if len(operands) > 2 else None
        buffer = next((i for i, n in params.items() if n == operands[0]), None)
        if buffer is not None and buffer < len(reads) and update in result_of:
            reads[buffer], written = 0, result_of[update][1]
    return reads, written


def program_costs(hlo: str, further_rounds: int = 0) -> dict[str, float]:
    """Per device per step, from compiled HLO: `flops` of its matmuls (2 x result x contracted size of
    every dot, fused or not) and `bytes` its kernels read and write (each fusion's and unfused
    op's operands and result), loop bodies times their trip count. (XLA's own cost analysis
    counts a loop body once: for a model whose layers are a scan, about one layer's worth.) Work
    in custom calls counts 0 here; a conditional counts its cheapest branch (the model's only one
    picks cuDNN attention, or a blockwise fallback for rows of over 64 documents). The expert-
    parallel exchange's overflow loop runs `further_rounds` times (`trip_count`)."""
    module = parse(hlo)
    comps = module.computations
    memo: dict[str, tuple[float, float]] = {}

    def cost(name: str, depth: int = 0) -> tuple[float, float]:
        if name in memo or name not in comps or depth > 64:
            return memo.get(name, (0.0, 0.0))
        shapes: dict[str, str] = {}
        flops = traffic = 0.0
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result, op, operands, attrs = m.group(2), m.group(3), re.findall(r"%?([\w.\-]+)", m.group(4)), m.group(5)
            shapes[m.group(1)] = result
            if op == "dot" and (c := _CONTRACTING.search(attrs)) and operands:
                lhs = _dims(shapes.get(operands[0], ""))
                contracted = math.prod(lhs[int(i)] for i in c.group(1).split(",") if i and int(i) < len(lhs))
                flops += 2.0 * math.prod(_dims(result)) * contracted
            if op not in _NO_TRAFFIC and not op.endswith(("-start", "-done")):
                sizes = [sum(array_bytes(shapes.get(o, ""))) for o in operands]
                written = sum(array_bytes(result))
                if op == "fusion" and (c := re.search(r"\bcalls=%?([\w.\-]+)", attrs)):
                    sizes, written = fused_traffic(comps.get(c.group(1), []), sizes, written)
                elif op in ("dynamic-slice", "gather", "slice"):
                    sizes = [written]  # reads what it returns
                elif op in ("dynamic-update-slice", "scatter") and len(sizes) > 1:
                    sizes, written = sizes[1:], sum(sizes[1:])  # in place: reads and writes the update
                traffic += written + sum(sizes)
            trip = trip_count(attrs, further_rounds)
            for kind, callee in _CALLEE.findall(attrs):
                if kind == "to_apply":  # a reduction's scalar computation: part of the op counted above
                    continue
                f, b = cost(callee, depth + 1)
                times = trip if kind == "body" else 1
                flops += times * f
                traffic += times * b if op != "fusion" else 0.0  # a fusion's traffic is its operands and result
            for group in _BRANCHES.findall(attrs):
                branches = [cost(c, depth + 1) for c in re.findall(r"%?([\w.\-]+)", group)]
                if branches:
                    f, b = min(branches)
                    flops, traffic = flops + f, traffic + b
        memo[name] = (flops, traffic)
        return memo[name]

    flops, traffic = cost(module.entry)
    return {"flops": flops, "bytes": traffic}


def wire_factor(kind: str, n: int) -> float:
    """Bytes each device sends per byte of the collective's buffer, for the usual ring and
    pairwise algorithms: all-reduce 2(n-1)/n of its input, all-gather (n-1)/n of its output,
    reduce-scatter and all-to-all (n-1)/n of their input, a permute all of it."""
    if kind == "collective-permute":
        return 1.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


def collectives(hlo: str, domain: int, further_rounds: int = 0) -> dict[str, dict]:
    """Per kind: count per step, buffer bytes per device per step, and the bytes each device sends
    over NVLink (groups inside one domain of `domain` consecutive devices) or the network.

    Reads compiled HLO: a collective's results are the result type of its synchronous op or of
    its `-done` (whose `-start` holds the groups); several combined into one op count once, with
    their bytes summed. The buffer is what the op holds: a reduce-scatter's input (n x its result),
    else its result; a ragged all-to-all's is its whole receive buffer, an upper bound of what
    the routing sends."""
    module = parse(hlo)
    runs = executions(module, further_rounds)
    out: dict[str, dict] = {}
    started: dict[str, str] = {}  # async start's name -> its line (the groups)
    for name, lines in module.computations.items():
        if not runs.get(name):
            continue
        for line in lines:
            m = _OP.search(line)
            if not m:
                continue
            kind, op = m.group(2), line[m.start(2) : line.index("(", m.start(2))]
            if op.endswith("-start"):
                started[_NAME.match(line).group(1)] = line
                continue
            if op.endswith("-done"):
                start = started.get(_DONE_OF.search(line).group(1), "")
            else:
                start = line
            groups = replica_groups(start) or [[0]]
            if kind == "collective-permute":
                n, local = 2, all(a // domain == b // domain for a, b in groups)
            else:
                n, local = max(len(g) for g in groups), all(len({d // domain for d in g}) == 1 for g in groups)
            if n < 2:
                continue
            size = sum(array_bytes(m.group(1))) * (n if kind == "reduce-scatter" else 1)
            k = out.setdefault(kind, {"count": 0, "bytes": 0, "nvlink_bytes": 0.0, "network_bytes": 0.0})
            times = runs[name]
            k["count"] += times
            k["bytes"] += times * size
            k["nvlink_bytes" if local else "network_bytes"] += times * size * wire_factor(kind, n)
    return out
