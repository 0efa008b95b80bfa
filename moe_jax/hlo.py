"""Reading compiled HLO text: which computation runs how often (loop bodies times their trip
count), the collectives a program runs (bytes, groups, NVLink or network), and what its kernels
compute and move (matmul FLOPs, bytes read and written). XLA's own cost analysis counts a loop
body once; a model whose layers are a scan needs the counts below. For `moe-jax plan`."""

from __future__ import annotations

import collections
import math
import re
from typing import Callable, NamedTuple

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start|-done)?\(")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_DONE_OF = re.compile(r"-done\(%?([\w.\-]+)")
_SHAPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|calls|to_apply)=%?([\w.\-]+)")
# a conditional's branches, in either form XLA prints: an indexed conditional's list, or a boolean
# one's pair
_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|\btrue_computation=(%?[\w.\-]+), false_computation=(%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# The expert-parallel exchange's further rounds (moe_jax.parallel.ep): a while loop whose trip count
# the routing decides at run time, zero in the common case (Routing.overflow counts them in training).
_FURTHER_ROUNDS = re.compile(r'op_name="[^"]*ep_further_rounds/while"')


def branches(attrs: str) -> list[str]:
    """The branch computations a conditional instruction names (none for other instructions)."""
    return [c.lstrip("%") for m in _BRANCHES.finditer(attrs) for group in m.groups() if group
            for c in re.findall(r"%?([\w.\-]+)", group)]  # fmt: skip


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
            for callee in branches(line):
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
    the fusion only slices (directly or through bitcasts) is read as its slices; a fusion whose root
    updates a slice of an operand in place (directly or through bitcasts) writes (and reads) only
    the update."""
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

    def uses_of(name):  # (user, its op, size, operands), through bitcasts (which move no data)
        for u in users[name]:
            if result_of[u][0] == "bitcast":
                yield from uses_of(u)
            else:
                yield (name, *result_of[u])

    reads = list(sizes)
    for i, name in params.items():
        uses = list(uses_of(name))
        if (
            i < len(reads)
            and uses
            and all(op in ("dynamic-slice", "gather", "slice") and ops[0] == of for of, op, _, ops in uses)
        ):
            reads[i] = sum(size for _, _, size, _ in uses)  # only sliced (as the operand, not an index)
    if root is not None and result_of[root][0] in ("dynamic-update-slice", "scatter"):
        op, _, operands = result_of[root]
        update = operands[1 if op == "dynamic-update-slice" else 2] if len(operands) > 2 else None
        target = operands[0]
        while target in result_of and result_of[target][0] == "bitcast":  # the buffer seen in another shape
            target = result_of[target][2][0]
        buffer = next((i for i, n in params.items() if n == target), None)
        if buffer is not None and buffer < len(reads) and update in result_of:
            reads[buffer], written = 0, result_of[update][1]
    return reads, written


def own_cost(op: str, result: str, operands: list[str], attrs: str, shapes: dict, comps: dict) -> tuple[float, float]:
    """(matmul FLOPs, bytes read and written) of one instruction itself, not counting the
    computations it calls: a dot's 2 x result x contracted size; a kernel's operands and result
    (a fusion's as `fused_traffic` reads them; slices read what they return; in-place updates
    read and write the update)."""
    flops = traffic = 0.0
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
    return flops, traffic


def instructions(lines: list[str]):
    """(name, result type, op, operand names, attributes) of each instruction line."""
    for line in lines:
        if m := _INSTRUCTION.match(line):
            yield m.group(1), m.group(2), m.group(3), re.findall(r"%?([\w.\-]+)", m.group(4)), m.group(5)


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
        for iname, result, op, operands, attrs in instructions(comps[name]):
            shapes[iname] = result
            f, b = own_cost(op, result, operands, attrs, shapes, comps)
            flops, traffic = flops + f, traffic + b
            trip = trip_count(attrs, further_rounds)
            for kind, callee in _CALLEE.findall(attrs):
                if kind == "to_apply":  # a reduction's scalar computation: part of the op counted above
                    continue
                f, b = cost(callee, depth + 1)
                times = trip if kind == "body" else 1
                flops += times * f
                traffic += times * b if op != "fusion" else 0.0  # a fusion's traffic is its operands and result
            if costs := [cost(c, depth + 1) for c in branches(attrs)]:
                f, b = min(costs)
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


def network_share(kind: str, group: list[int], domain: int) -> float:
    """Bytes each device sends over the network per byte of the buffer, for a group spanning NVLink
    domains of `domain` consecutive devices (the rest of `wire_factor` goes over NVLink); the
    device in the domain with the fewest members of the group (g of n) bounds it.

    An all-to-all (ragged or not) sends each peer its own part: (n - g)/n of the buffer leaves
    for other domains, each device through its own NIC. An all-gather, reduce-scatter or
    all-reduce moves the same data whichever member holds it, and NCCL's rings and trees over a
    rail-optimized network split it over the domain's g NICs: a domain receives (n - g)/n of an
    all-gather's output, g NICs carry it, (n - g)/(n g) each (twice for an all-reduce); that is
    a bus bandwidth of g x the NIC's, 400 GB/s on nodes of 8 H100s with 400 Gb/s NICs, as
    nccl-tests measure across nodes."""
    members = collections.Counter(d // domain for d in group)
    n, g = len(group), min(members.values())
    if len(members) == 1:
        return 0.0
    if kind == "collective-permute":
        return 1.0
    if kind in ("all-to-all", "ragged-all-to-all"):
        return (n - g) / n
    return (2.0 if kind == "all-reduce" else 1.0) * (n - g) / (n * g)


def collective_ops(hlo: str, domain: int, further_rounds: int = 0):
    """Each collective of a compiled program: {kind, result (its type), op_name, runs (per step),
    bytes (its buffer), nvlink_bytes and network_bytes (sent per device, one run)}.

    A collective's results are the result type of its synchronous op or of its `-done` (whose
    `-start` holds the groups); several combined into one op count once, with their bytes
    summed. The buffer is what the op holds: a reduce-scatter's input (n x its result), else its
    result; a ragged all-to-all's is its whole receive buffer, an upper bound of what the routing
    sends."""
    module = parse(hlo)
    runs = executions(module, further_rounds)
    started: dict[str, str] = {}  # async start's name -> its line (the groups)
    caller_op_name = {}  # an async computation's collective carries no op_name; its async-start does
    for lines in module.computations.values():
        for line in lines:
            callee, where = re.search(r"\bcalls=%?([\w.\-]+)", line), re.search(r'op_name="([^"]*)"', line)
            if " async-start(" in line and callee and where:
                caller_op_name[callee.group(1)] = where.group(1)
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
            start = started.get(_DONE_OF.search(line).group(1), "") if op.endswith("-done") else line
            size, nvlink, network = collective_bytes(kind, start, m.group(1), domain)
            if not size:
                continue
            where = re.search(r'op_name="([^"]*)"', start) or re.search(r'op_name="([^"]*)"', line)
            yield {
                "kind": kind,
                "result": m.group(1).strip(),
                "op_name": where.group(1) if where else caller_op_name.get(name, ""),
                "runs": runs[name],
                "bytes": size,
                "network_bytes": network,
                "nvlink_bytes": nvlink,
            }


def collectives(hlo: str, domain: int, further_rounds: int = 0) -> dict[str, dict]:
    """Per kind (`collective_ops`): count per step, buffer bytes per device per step, and the bytes
    each device sends over NVLink (inside a domain of `domain` consecutive devices) and over the
    network between domains (`network_share`; until this version a group spanning domains
    counted every byte as network, up to 8x the network time of an FSDP gather over nodes of 8)."""
    out: dict[str, dict] = {}
    for c in collective_ops(hlo, domain, further_rounds):
        k = out.setdefault(c["kind"], {"count": 0, "bytes": 0, "nvlink_bytes": 0.0, "network_bytes": 0.0})
        k["count"] += c["runs"]
        for key in ("bytes", "network_bytes", "nvlink_bytes"):
            k[key] += c["runs"] * c[key]
    return out


def largest_collectives(hlo: str, domain: int, n: int = 5) -> list[dict]:
    """The n collectives that move the most bytes a step (buffer x runs), those of one op summed
    over its runs: kind, result type (the operand shapes), where in the model (op_name), runs,
    and bytes a step (buffer, sent over NVLink, over the network)."""
    merged: dict[tuple, dict] = {}
    for c in collective_ops(hlo, domain):
        key = (c["kind"], c["result"], c["op_name"])
        m = merged.setdefault(key, {**c, "runs": 0, "bytes": 0.0, "network_bytes": 0.0, "nvlink_bytes": 0.0})
        m["runs"] += c["runs"]
        for k in ("bytes", "network_bytes", "nvlink_bytes"):
            m[k] += c["runs"] * c[k]
    return sorted(merged.values(), key=lambda c: -c["bytes"])[:n]


class Rates(NamedTuple):
    """A device's rates for `scheduled_time`: dense BF16 FLOP/s, HBM, NVLink and network bytes/s,
    and dense FP8 FLOP/s for custom calls that multiply FP8 operands (0: the BF16 rate)."""

    flops: float
    hbm: float
    nvlink: float
    network: float
    fp8_flops: float = 0.0


def fp8_operands(line: str) -> bool:
    """Whether a custom call's first operand (a GEMM's left-hand side) is FP8, as in Transformer
    Engine's MXFP8 grouped GEMM."""
    layouts = line.split("operand_layout_constraints=", 1)
    return len(layouts) == 2 and layouts[1].startswith("{f8e")


def collective_bytes(kind: str, line: str, result: str, domain: int) -> tuple[int, float, float]:
    """(its buffer's bytes, bytes a device sends over NVLink, over the network) for one collective:
    `line` holds its groups, `result` its result type; all 0 for a group of one."""
    groups = replica_groups(line) or [[0]]
    n = 2 if kind == "collective-permute" else max(len(g) for g in groups)
    if n < 2:
        return 0, 0.0, 0.0
    size = sum(array_bytes(result)) * (n if kind == "reduce-scatter" else 1)
    network = max(network_share(kind, g, domain) for g in groups)
    return size, size * max(wire_factor(kind, n) - network, 0.0), size * network


CallFlops = Callable[[str, str], float]  # (custom call target, its instruction's line) -> FLOPs


def custom_call_work(hlo: str, call_flops: CallFlops) -> dict[str, float]:
    """FLOPs done inside custom calls in one execution of the program, by target: each call's
    `call_flops` times the times its computation runs (`executions`)."""
    module = parse(hlo)
    runs = executions(module)
    out: collections.Counter = collections.Counter()
    for name, lines in module.computations.items():
        for line in lines:
            if runs.get(name) and (target := re.search(r'custom_call_target="([^"]+)"', line)):
                out[target.group(1)] += runs[name] * call_flops(target.group(1), line)
    return {t: f for t, f in out.items() if f}


def scheduled_time(hlo: str, rates: Rates, domain: int, call_flops: CallFlops | None = None, top: int = 8) -> dict:
    """The step's time as its compiled schedule allows, per device: every kernel takes its own
    roofline time (its FLOPs at the peak or its bytes at HBM bandwidth, whichever is longer; a custom
    call the FLOPs `call_flops` gives it, at the FP8 peak if it multiplies FP8); a collective takes its bytes over NVLink
    and the network (the slower of the two), and is hidden only while kernels run between its
    asynchronous start and done, one collective after another in the order they started. A
    synchronous collective (or one XLA scheduled as such: "is_sync") is exposed whole.

    Returns kernel_s (the kernels back to back), exposed_s (communication no kernel hides),
    communication_s (all of it), the step, kernel_s + exposed_s, the kernels that take the most
    time, by where in the model they come from (op_name, its last scopes), and the collectives
    whose exposed time is largest (kind and where)."""
    module = parse(hlo)
    comps = module.computations
    memo: dict[str, tuple[float, float, float, collections.Counter, collections.Counter]] = {}

    def root_collective(name: str):
        for line in comps.get(name, []):
            if line.lstrip().startswith("ROOT") and (m := _OP.search(line)):
                return m.group(2), line, m.group(1)
        return None

    def walk(name: str, depth: int = 0) -> tuple[float, float, float, collections.Counter, collections.Counter]:
        """(kernel seconds, exposed communication seconds, all communication seconds, kernel
        seconds by op_name, exposed seconds by collective and op_name) of one run."""
        if name in memo or name not in comps or depth > 64:
            return memo.get(name, (0.0, 0.0, 0.0, collections.Counter(), collections.Counter()))
        lines = list(instructions(comps[name]))
        done_result = {ops[0]: result for _, result, op, ops, _ in lines if op.endswith("-done") and ops}
        shapes: dict[str, str] = {}
        in_flight: dict[str, float] = {}  # started, not done: seconds left
        label: dict[str, str] = {}  # a started collective's kind and where
        busy = exposed = total = 0.0
        kernels: collections.Counter = collections.Counter()
        exposures: collections.Counter = collections.Counter()

        def expose(seconds: float, what: str) -> None:
            nonlocal exposed
            exposed += seconds
            if seconds:
                exposures[what] += seconds

        def run(seconds: float, where: str | None = None) -> None:  # kernels: collectives in flight progress
            nonlocal busy
            busy += seconds
            if where is not None:
                kernels[where] += seconds
            for key in in_flight:
                used = min(in_flight[key], seconds)
                in_flight[key] -= used
                seconds -= used
                if seconds <= 0:
                    break

        for iname, result, op, operands, attrs in lines:
            shapes[iname] = result
            line = f"{result} {op}({','.join(operands)}){attrs}"
            callee = re.search(r"\bcalls=%?([\w.\-]+)", attrs)
            event = None
            if op == "async-start" and callee and (found := root_collective(callee.group(1))):
                kind, group_line, result_type = found
                event = ("start", kind, group_line, result_type)
            elif op.endswith("-start") and op[: -len("-start")] in COLLECTIVES:
                event = ("start", op[: -len("-start")], line, done_result.get(iname, result))
            elif op in COLLECTIVES:
                event = ("sync", op, line, result)
            if op == "async-start" and callee and not event:  # other work on another stream: as a call
                b, _, _, k, _ = walk(callee.group(1), depth + 1)
                run(b)
                kernels.update(k)
                continue
            if event:
                _, nvlink, network = collective_bytes(event[1], event[2], event[3], domain)
                seconds = max(nvlink / rates.nvlink, network / rates.network)
                total += seconds
                shape = _SHAPE.search(event[3])
                what = f"{event[1]} {shape.group(0) if shape else ''} {where_of(event[2], '')}".strip()
                if event[0] == "sync" or '"is_sync":true' in attrs:
                    expose(seconds, what)
                else:
                    in_flight[iname], label[iname] = seconds, what
                continue
            if op == "async-done" or op.endswith("-done"):
                if operands and operands[0] in in_flight:
                    expose(in_flight.pop(operands[0]), label[operands[0]])
                continue
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', attrs)
                flops = call_flops(target.group(1), line) if call_flops and target else 0.0
                rate = rates.fp8_flops if rates.fp8_flops and fp8_operands(line) else rates.flops
                _, traffic = own_cost(op, result, operands, attrs, shapes, comps)
                run(max(flops / rate, traffic / rates.hbm), where_of(attrs, iname))
                continue
            flops, traffic = own_cost(op, result, operands, attrs, shapes, comps)
            if op == "fusion":
                inner = cost_of_fusion(comps, callee.group(1)) if callee else 0.0
                run(max((flops + inner) / rates.flops, traffic / rates.hbm), where_of(attrs, iname))
                continue
            if flops or traffic:
                run(max(flops / rates.flops, traffic / rates.hbm), where_of(attrs, iname))
            trip = trip_count(attrs)
            for kind, name_ in _CALLEE.findall(attrs):
                if kind in ("to_apply", "calls") and op != "call":
                    continue
                b, e, t, k, x = walk(name_, depth + 1)
                times = trip if kind == "body" else 1
                run(times * b)
                exposed, total = exposed + times * e, total + times * t
                kernels.update({key: times * v for key, v in k.items()})
                exposures.update({key: times * v for key, v in x.items()})
            if walks := [walk(c, depth + 1) for c in branches(attrs)]:
                b, e, t, k, x = min(walks, key=lambda x: x[:3])
                run(b)
                exposed, total = exposed + e, total + t
                kernels.update(k)
                exposures.update(x)
        for key, seconds in in_flight.items():  # started and never waited for here
            expose(seconds, label[key])
        memo[name] = (busy, exposed, total, kernels, exposures)
        return memo[name]

    busy, exposed, total, kernels, exposures = walk(module.entry)
    return {
        "kernel_s": busy,
        "exposed_s": exposed,
        "communication_s": total,
        "step_s": busy + exposed,
        "kernels": [{"op_name": k, "seconds": v} for k, v in kernels.most_common(top)],
        "exposed": [{"collective": k, "seconds": v} for k, v in exposures.most_common(top)],
    }


def where_of(attrs: str, name: str) -> str:
    """Where in the model an instruction comes from: the last scopes of its op_name."""
    m = re.search(r'op_name="([^"]*)"', attrs)
    return "/".join(m.group(1).split("/")[-3:]) if m else name


def cost_of_fusion(comps: dict, name: str) -> float:
    """Matmul FLOPs inside a fusion's computation (a GEMM fusion's dot)."""
    shapes: dict[str, str] = {}
    flops = 0.0
    for iname, result, op, operands, attrs in instructions(comps.get(name, [])):
        shapes[iname] = result
        if op == "dot":
            flops += own_cost(op, result, operands, attrs, shapes, comps)[0]
    return flops
