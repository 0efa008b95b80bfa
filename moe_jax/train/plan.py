"""`moe-jax plan`: what a training run needs on a GPU cluster, from XLA's GPU compiler, without the
cluster.

The run config's exact training step (forward, backward, optimizer update, router bias update,
MTP; its mesh, remat and offload) is compiled for a deviceless cluster of `hosts` x
`gpus_per_host` GPUs of a target kind (moe_jax.gpu), or for this machine's CPU devices. Nothing
is allocated: parameters, optimizer state and batch are abstract arrays on their shardings.
From the compiled program, per device:

- memory: parameters, optimizer state and buffers (their shards), XLA's peak (arguments,
  temporaries and outputs at once) and host-offloaded bytes, against the device's memory;
- FLOPs: the program's matmuls, counted from its HLO (`program_costs`), and, separately, the
  work done in custom calls (Mosaic GPU / Transformer Engine grouped GEMMs, cuDNN attention),
  each call's FLOPs from the model's shapes times how often it runs (`custom_call_flops`);
- collectives: bytes per step by kind, read from the HLO (a collective inside the layer scan
  counts once per layer), and the bytes each device sends over NVLink or the network;
- an estimated step time and MFU from a roofline of the target's datasheet rates (see
  `roofline`): an estimate, not a measurement.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moe_jax import gpu
from moe_jax.config import ModelConfig
from moe_jax.hlo import (
    CallFlops,
    Rates,
    collectives,
    custom_call_work,
    fp8_operands,
    largest_collectives,
    program_costs,
    scheduled_time,
)
from moe_jax.model import remat_policy
from moe_jax.parallel.ep import exchange_bytes_per_row, expert_axes, rows_per_stage
from moe_jax.params import leaf_dtype, param_shapes, set_path
from moe_jax.sharding import batch_sharding, leaf_sharding, mesh_from_spec
from moe_jax.train import objective as obj
from moe_jax.train.config import TrainConfig
from moe_jax.train.loop import check_batch_split, check_stage, expert_parallel, make_optimizer, make_step, open_start
from moe_jax.train.step import TrainStep, optimizer_shardings

GIB = 2**30
# What a GPU needs beyond XLA's buffers: the CUDA context, cuBLAS/cuDNN workspaces and NCCL's
# buffers. A rule of thumb (1-3 GiB is typical); a plan fits when XLA's peak plus this fits.
RUNTIME_RESERVE = 3 * GIB


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the plan is for: `target` GPUs (a key of gpu.TARGETS, or "cpu": this machine)."""

    target: str
    hosts: int = 1
    gpus_per_host: int = 1
    spec: gpu.Target | None = None  # the target's figures (default: gpu.TARGETS[target])

    @property
    def devices(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def figures(self) -> gpu.Target | None:
        return self.spec or gpu.TARGETS.get(self.target)

    @property
    def nvlink_domain(self) -> int:
        """GPUs of the job that NVLink connects: a board of 8 (HGX) never spans more than its host;
        a GB200/GB300 NVL72 rack (18 hosts of 4) spans hosts, and a job's hosts are spread evenly
        over the fewest racks that hold them (128 GPUs: 2 racks of 64, 16 hosts each, as a
        scheduler's topology blocks place them), so a mesh axis of 64 stays inside a rack."""
        domain = self.figures.nvlink_domain
        if domain <= 8:
            return min(domain, self.gpus_per_host)
        per_rack = domain // self.gpus_per_host
        racks = -(-self.hosts // per_rack)
        return (self.hosts // racks) * self.gpus_per_host if self.hosts % racks == 0 else per_rack * self.gpus_per_host


def target_from_file(path) -> gpu.Target:
    """A gpu.Target from a JSON file of its fields (those of moe_jax.gpu.Target), each checked:
    the description a string, the capability [major, minor], counts and sizes integers >= 1,
    rates finite numbers > 0 (the peak FP8 rate may be 0: FP8 counted at the BF16 peak)."""
    fields = {f.name: f for f in dataclasses.fields(gpu.Target)}
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON GPU description ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of GPU fields, got {type(values).__name__}")
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown target fields {unknown} (known: {', '.join(sorted(fields))})")
    # (the BF16 peak and NVLink's rate default to 0: the estimate divides by them)
    required = [
        n for n, f in fields.items() if f.default is dataclasses.MISSING or (f.default == 0 and n != "peak_fp8_flops")
    ]
    missing = sorted(n for n in required if n not in values)
    if missing:
        raise ValueError(f"{path}: missing target fields {missing}")
    for name, value in values.items():
        kind = fields[name].type
        if name == "description":
            ok = isinstance(value, str)
        elif name == "capability":
            ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)
        elif kind == "int":
            ok = type(value) is int and value >= 1
        else:
            low = 0 if name == "peak_fp8_flops" else math.ulp(0)
            ok = type(value) in (int, float) and math.isfinite(value) and value >= low
        if not ok:
            raise ValueError(f"{path}: {name}={value!r} is not a valid {gpu_field_kind(name, kind)}")
    return gpu.Target(**{**values, "capability": tuple(values["capability"])})


def gpu_field_kind(name: str, kind: str) -> str:
    return {"description": "string", "capability": "[major, minor]"}.get(
        name, "integer >= 1" if kind == "int" else "finite number > 0"
    )


# ---- the abstract training state ----------------------------------------------------------------
def abstract_state(model_cfg: ModelConfig, cfg: TrainConfig, tx, mesh) -> dict:
    """{params, buffers, opt_state, step} as ShapeDtypeStructs on the shardings `train` gives them."""
    tree: dict = {}
    for path, (shape, rule) in param_shapes(model_cfg, cfg.model.mtp).items():
        dtype = leaf_dtype(rule, cfg.model.param_dtype)
        set_path(tree, path, jax.ShapeDtypeStruct(shape, dtype, sharding=leaf_sharding(mesh, path, shape)))
    params = tree["params"]
    opt_shardings = optimizer_shardings(tx, params, mesh)
    opt_state = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params),
        opt_shardings,
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return {"params": params, "buffers": tree.get("buffers", {}), "opt_state": opt_state, "step": step}


def abstract_batch(cfg: TrainConfig, mesh) -> dict:
    b, s = cfg.data.batch_size, cfg.data.seq_len
    shapes = {"tokens": (b, s + 1), "segment_ids": (b, s + 1), "positions": (b, s)}
    return {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=batch_sharding(mesh, v)) for k, v in shapes.items()}


def device_bytes(tree) -> int:
    """Bytes of the shards one device holds of every leaf (the largest shard where they differ)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- FLOPs --------------------------------------------------------------------------------------
def custom_call_flops(model_cfg: ModelConfig, cfg: TrainConfig, devices: int) -> CallFlops:
    """FLOPs of one custom call, which XLA counts as 0, from its target and HLO line:
    - a grouped GEMM (Mosaic GPU, Transformer Engine): every call, forward, recomputed forward,
      input or weight gradient, multiplies a device's routed rows of one micro-batch through one
      [hidden, moe_intermediate] matrix per expert: 2 x rows x hidden x moe_intermediate, with the
      rows of balanced routing (the micro-batch's tokens on the device, or a chunk of them with
      `model.ep_chunk`, x experts a token);
    - cuDNN attention: causal, from the call's q [B, S, N, Dqk] and v [.., Dv] operands:
      B x N x S^2 x (Dqk + Dv) forward (QK^T and PV over half the pairs), twice that backward.
    Each call is counted as often as it runs: the recomputation of remat included."""
    tokens = cfg.data.batch_size // cfg.optim.grad_accum * cfg.data.seq_len / devices  # a device's, a micro-batch
    if cfg.model.ep_chunk is not None:  # the MoE layer takes them a chunk at a time, a call each
        tokens = min(tokens, cfg.model.ep_chunk)
    rows = tokens * model_cfg.num_experts_per_tok
    per_gemm = 2.0 * rows * model_cfg.hidden_size * model_cfg.moe_intermediate_size

    def flops(target: str, line: str) -> float:
        if target.startswith(("mosaic_gpu", "te_grouped_gemm")):
            return per_gemm
        if target.startswith("__cudnn$fmha"):
            operands = line.split("operand_layout_constraints=", 1)[1]  # q, k, v first
            shapes = [[int(d) for d in dims.split(",")] for dims in re.findall(r"\[([\d,]+)\]", operands)[:3]]
            (b, s, n, dqk), dv = shapes[0], shapes[2][-1]
            forward = float(b) * n * s * s * (dqk + dv)
            return 2 * forward if "Backward" in target else forward
        return 0.0

    return flops


def custom_call_totals(hlo: str, call_flops: CallFlops) -> dict:
    """Per device per step, the FLOPs of the custom calls by kind (grouped_gemm, attention)."""
    kinds = {"grouped_gemm": ("mosaic_gpu", "te_grouped_gemm"), "attention": ("__cudnn$fmha",)}
    work = custom_call_work(hlo, call_flops)
    out = {kind: sum(f for t, f in work.items() if t.startswith(prefixes)) for kind, prefixes in kinds.items()}
    return {kind: f for kind, f in out.items() if f}


# ---- the roofline -------------------------------------------------------------------------------
def roofline(figures: gpu.Target, flops: float, hbm_bytes: float, comms: dict, fp8_flops: float = 0.0) -> dict:
    """Seconds per step on one device: compute (FLOPs / dense BF16 peak; `fp8_flops` of them, FP8
    matmuls, at the dense FP8 peak where the target gives one), memory (the bytes its
    kernels read and write, `moe_jax.hlo.program_costs` / HBM bandwidth), NVLink and network
    (bytes sent / one direction's bandwidth). The step takes at least the largest of them (everything
    overlapped) and at most their sum (nothing overlapped); real steps fall between, and lose
    more to kernel efficiency (GEMMs rarely exceed 70-80% of peak)."""
    parts = {
        "compute_s": (flops - fp8_flops) / figures.peak_bf16_flops
        + fp8_flops / (figures.peak_fp8_flops or figures.peak_bf16_flops),
        "memory_s": hbm_bytes / figures.memory_bandwidth,
        "nvlink_s": sum(k["nvlink_bytes"] for k in comms.values()) / figures.nvlink_bandwidth,
        "network_s": sum(k["network_bytes"] for k in comms.values()) / figures.network_bandwidth,
    }
    return {**parts, "overlapped_s": max(parts.values()), "serial_s": sum(parts.values())}


def schedule_estimate(hlo: str, figures: gpu.Target, domain: int, call_flops: CallFlops, model_flops: float) -> dict:
    """The step as the compiled schedule runs it (`moe_jax.hlo.scheduled_time`): each kernel at its
    own roofline, each collective hidden only behind the kernels scheduled between its start and
    done. `no_overlap_s` credits no overlap at all (kernels, then every collective); `step_s` the
    schedule's. Custom calls take the FLOPs `custom_call_flops` gives each."""
    rates = Rates(
        figures.peak_bf16_flops,
        figures.memory_bandwidth,
        figures.nvlink_bandwidth,
        figures.network_bandwidth,
        figures.peak_fp8_flops,
    )
    t = scheduled_time(hlo, rates, domain, call_flops)
    t["no_overlap_s"] = t["kernel_s"] + t["communication_s"]
    t["mfu"] = model_flops / (t["step_s"] * figures.peak_bf16_flops)
    t["mfu_no_overlap"] = model_flops / (t["no_overlap_s"] * figures.peak_bf16_flops)
    return t


# ---- the expert-parallel exchange ---------------------------------------------------------------
def expert_exchange(cfg: TrainConfig, c: "CompiledStep", hlo: str, comms: dict, domain: int) -> dict | None:
    """The MoE layers' token exchange per token (of a device) per MoE layer, read from the HLO
    (its ragged all-to-alls; the fixed all-to-all on CPU), beside the analytic count for balanced
    routing (`moe_jax.parallel.ep.rows_per_token` rows, `exchange_bytes_per_row` each). Its
    overflow loop counts 0 times in `comms` (none in the common case); `further_round_*`: what one
    further round of every layer's exchange would add per device and step."""
    if not expert_axes(c.mesh):
        return None
    m = c.model_cfg
    mtp = m.num_nextn_predict_layers if cfg.model.mtp else 0
    layer_tokens = cfg.data.batch_size * cfg.data.seq_len / len(c.devices) * (m.num_moe_layers + mtp)
    kind = "ragged-all-to-all" if "ragged-all-to-all" in comms else "all-to-all"
    once_more = collectives(hlo, domain, further_rounds=1).get(kind, {})
    sent = comms.get(kind, {"nvlink_bytes": 0.0, "network_bytes": 0.0})
    analytic = analytic_exchange(cfg, m, c.mesh, domain)
    return {
        "collective": kind,
        "network_bytes_per_token_layer": sent["network_bytes"] / layer_tokens,
        "nvlink_bytes_per_token_layer": sent["nvlink_bytes"] / layer_tokens,
        "analytic_network_rows_per_token": sum(s["network"] for s in rows_per_stage(m, c.mesh, domain)),
        "analytic_network_bytes_per_token_layer": analytic["network"],
        "analytic_nvlink_bytes_per_token_layer": analytic["nvlink"],
        "further_round_network_bytes": once_more.get("network_bytes", 0.0) - sent["network_bytes"],
        "further_round_nvlink_bytes": once_more.get("nvlink_bytes", 0.0) - sent["nvlink_bytes"],
    }


def analytic_exchange(cfg: TrainConfig, m, mesh, domain: int) -> dict[str, float]:
    """The exchange's bytes per token per MoE layer for balanced routing, over the network and over
    NVLink (`rows_per_stage` rows, `exchange_bytes_per_row` each), averaged over the layers: the
    decoder's layers send their dispatch again when the backward recomputes them (remat; not the
    outer stage's under "save_dispatch", which keeps it), MTP's layers are not rematerialized."""
    options, remat = expert_parallel(cfg), remat_policy(cfg.model.remat)
    mtp = m.num_nextn_predict_layers if cfg.model.mtp else 0
    row = functools.partial(
        exchange_bytes_per_row, m, options, cfg.model.backend, jnp.dtype(cfg.model.compute_dtype).itemsize
    )

    def per_row(stage: int) -> float:
        resent = remat != "none" and not (remat == "save_dispatch" and stage == 0)
        return (m.num_moe_layers * row(2 if resent else 1) + mtp * row(1)) / (m.num_moe_layers + mtp)

    stages_ = rows_per_stage(m, mesh, domain)
    return {way: sum(s[way] * per_row(i) for i, s in enumerate(stages_)) for way in ("network", "nvlink")}


# ---- the plan -----------------------------------------------------------------------------------
@dataclasses.dataclass
class CompiledStep:
    """The training step compiled for a cluster, and the abstract values it was compiled for."""

    compiled: jax.stages.Compiled
    step: TrainStep  # its numbers: the values `compiled` takes as its third argument
    state: dict
    batch: dict
    cluster: Cluster
    devices: list
    mesh: jax.sharding.Mesh
    model_cfg: ModelConfig
    figures: gpu.Target | None  # None: this machine's CPU
    seconds: float


def compile_step(cfg: TrainConfig, cluster: Cluster, log=lambda *a: None) -> CompiledStep:
    """`cfg`'s training step compiled for `cluster` (a deviceless GPU cluster, or this CPU)."""
    if cluster.target in ("cpu", "local"):
        here = jax.devices("cpu" if cluster.target == "cpu" else None)
        devices, figures = here[: cluster.devices], None
        if len(devices) < cluster.devices:
            raise ValueError(f"--target {cluster.target}: {cluster.devices} devices asked, {len(here)} here")
    else:
        figures = cluster.figures
        if figures is None:
            raise ValueError(f"unknown GPU target {cluster.target!r}; known: {', '.join(gpu.TARGETS)} (or --spec)")
        devices = gpu.topology(cluster.target, cluster.hosts, cluster.gpus_per_host, cluster.spec).devices
    spec = cfg.mesh or f"data={len(devices)}"
    mesh = mesh_from_spec(spec, devices)
    if mesh.size != len(devices):
        raise ValueError(f"mesh {spec!r} covers {mesh.size} of the cluster's {len(devices)} devices")
    check_batch_split(cfg, mesh)
    model_cfg = open_start(cfg).model_cfg
    check_stage(cfg, model_cfg)
    tx, schedule = make_optimizer(cfg)
    t0 = time.perf_counter()
    with gpu.compiling_for(devices) if figures is not None else contextlib.nullcontext():
        state = abstract_state(model_cfg, cfg, tx, mesh)
        batch = abstract_batch(cfg, mesh)
        step = make_step(cfg, model_cfg, tx, schedule, mesh, jax.tree.map(lambda x: x.sharding, state))
        lowered = step.lower(state, batch)
        log(f"plan: lowered in {time.perf_counter() - t0:.0f} s; compiling for {len(devices)} x {cluster.target}")
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:  # one line: the compiler's first, and what to change
            first = str(e).strip().splitlines()[0][:300]
            hint = ""
            if figures is not None and cfg.model.compute_dtype == "float32":  # no tiling for some f32 dots
                where = " on Blackwell" if figures.capability[0] >= 10 else ""
                hint = f" (float32 matmuls{where}: plan with model.compute_dtype=bfloat16, as a run would train)"
            raise ValueError(f"XLA could not compile the step for {cluster.target}: {first}{hint}") from None
    seconds = time.perf_counter() - t0
    return CompiledStep(compiled, step, state, batch, cluster, devices, mesh, model_cfg, figures, seconds)


def plan(cfg: TrainConfig, cluster: Cluster, log=lambda *a: None) -> dict:
    """Compile `cfg`'s training step for `cluster` and describe it (see the module docstring)."""
    return plan_of(cfg, compile_step(cfg, cluster, log))


def plan_of(cfg: TrainConfig, c: CompiledStep) -> dict:
    """The plan's figures (bytes, FLOPs and seconds per device and step) of a compiled step."""
    devices, model_cfg, figures, cluster = c.devices, c.model_cfg, c.figures, c.cluster
    mem = c.compiled.memory_analysis()
    hlo = c.compiled.as_text()
    calls = dict(collections.Counter(gpu.CUSTOM_CALL.findall(hlo)))
    cost = program_costs(hlo)
    domain = cluster.nvlink_domain if figures is not None else len(devices)
    comms = collectives(hlo, domain)
    exchange = expert_exchange(cfg, c, hlo, comms, domain)
    call_flops = custom_call_flops(model_cfg, cfg, len(devices))
    analytic = custom_call_totals(hlo, call_flops)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    model_flops = (
        obj.flops_per_token(model_cfg, cfg.data.seq_len, bool(cfg.model.mtp), cfg.dsa.stage) * tokens / len(devices)
    )
    outputs = max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0)  # those not reusing a donated input
    memory = {
        "params": device_bytes(c.state["params"]),
        "optimizer": device_bytes(c.state["opt_state"]),
        "buffers": device_bytes(c.state["buffers"]),
        "batch": device_bytes(c.batch),
        "arguments": mem.argument_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "outputs_not_aliased": outputs,
        # what the runtime holds while the step runs: its arguments, its temporaries (one block,
        # allocated whole at the start) and its new outputs
        "peak": mem.argument_size_in_bytes + mem.temp_size_in_bytes + outputs,
        "host_offloaded": mem.host_temp_size_in_bytes + mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes,
    }
    out = {
        "target": cluster.target,
        "device": figures.description if figures is not None else str(devices[0].device_kind),
        "hosts": cluster.hosts,
        "gpus_per_host": cluster.gpus_per_host,
        "devices": len(devices),
        "mesh": dict(c.mesh.shape),
        "remat": cfg.model.remat,
        "backend": cfg.model.backend,
        "param_dtype": cfg.model.param_dtype,
        "compute_dtype": cfg.model.compute_dtype,
        "batch": [cfg.data.batch_size, cfg.data.seq_len],
        "tokens_per_step": tokens,
        "memory": memory,
        "flops": {"program": cost["flops"], "custom_calls": analytic, "model": model_flops},
        "hbm_bytes": cost["bytes"],
        "collectives": comms,
        "largest_collectives": largest_collectives(hlo, domain),
        "custom_calls": calls,
        "compile_s": c.seconds,
    }
    if exchange:
        out["expert_exchange"] = exchange
    if figures is not None:
        need = memory["peak"] + RUNTIME_RESERVE
        out["device_memory"] = figures.memory_bytes
        out["fits"] = need <= figures.memory_bytes
        out["short_by"] = max(need - figures.memory_bytes, 0)
        done = cost["flops"] + sum(analytic.values())
        fp8 = sum(custom_call_work(hlo, lambda t, line: call_flops(t, line) if fp8_operands(line) else 0.0).values())
        est = roofline(figures, done, cost["bytes"], comms, fp8)
        peak = figures.peak_bf16_flops
        est["mfu_overlapped"] = model_flops / (est["overlapped_s"] * peak)
        est["mfu_serial"] = model_flops / (est["serial_s"] * peak)
        est["schedule"] = schedule_estimate(hlo, figures, domain, call_flops, model_flops)
        out["estimate"] = est
    return out


# ---- the report ---------------------------------------------------------------------------------
def describe_plan(p: dict) -> str:
    """The plan as a table for people (the JSON holds the same figures, in bytes and seconds)."""
    gib = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    mesh = " x ".join(f"{k}={v}" for k, v in p["mesh"].items())
    m = p["memory"]
    lines = [
        f"plan: {p['devices']} x {p['device']} ({p['hosts']} x {p['gpus_per_host']} per host), mesh {mesh}, "
        f"remat {p['remat']}, batch {p['batch'][0]} x {p['batch'][1]} tokens, {p['param_dtype']} weights, "
        f"{p['compute_dtype']} compute (compiled in {p['compile_s']:.0f} s)",
        "memory per device                   GiB",
        f"  parameters                  {gib(m['params'])}",
        f"  optimizer state             {gib(m['optimizer'])}",
        f"  buffers and batch           {gib(m['buffers'] + m['batch'])}",
        f"  temporaries (activations)   {gib(m['temporaries'])}",
        f"  XLA's peak                  {gib(m['peak'])}",
        f"  host-offloaded              {gib(m['host_offloaded'])}",
    ]
    if "fits" in p:
        verdict = "fits" if p["fits"] else f"does not fit: short by {p['short_by'] / GIB:.1f} GiB"
        lines += [
            f"  + runtime reserve           {gib(RUNTIME_RESERVE)}",
            f"  device memory               {gib(p['device_memory'])}   {verdict}",
        ]
    f = p["flops"]
    custom = ", ".join(f"{k} {v:.3g}" for k, v in f["custom_calls"].items()) or "none"
    lines += [
        "FLOPs per device per step",
        f"  matmuls in the program      {f['program']:.3g}",
        f"  in custom calls (analytic)  {custom}",
        f"  model (6N + attention)      {f['model']:.3g}",
        "collectives per device per step     count        GiB   sent over NVLink GiB   sent over network GiB",
    ]
    for kind, c in sorted(p["collectives"].items()):
        lines.append(
            f"  {kind:<28}{c['count']:9d} {c['bytes'] / GIB:10.2f} {c['nvlink_bytes'] / GIB:22.2f}"
            f" {c['network_bytes'] / GIB:23.2f}"
        )
    lines.append("  the largest (buffer GiB a step; network GiB; runs; where; result):")
    for c in p.get("largest_collectives", []):
        lines.append(
            f"    {c['kind']:<18} {c['bytes'] / GIB:8.2f} {c['network_bytes'] / GIB:8.2f} {c['runs']:6d}  "
            f"{c['op_name'][-60:]}  {c['result'][:70]}"
        )
    if "expert_exchange" in p:
        x, kib = p["expert_exchange"], 1024
        analytic = x["analytic_network_bytes_per_token_layer"]
        ratio = f" ({x['network_bytes_per_token_layer'] / analytic:.2f}x)" if analytic else ""
        lines += [
            f"expert exchange ({x['collective']}) per token per MoE layer: network "
            f"{x['network_bytes_per_token_layer'] / kib:.1f} KiB{ratio}, NVLink {x['nvlink_bytes_per_token_layer'] / kib:.1f} KiB; "
            f"balanced routing, analytic: {x['analytic_network_rows_per_token']:.2f} rows over the network, "
            f"{analytic / kib:.1f} KiB",
            f"  overflow rounds (none in the common case, counted 0 above): each further round of every MoE layer "
            f"adds {x['further_round_network_bytes'] / GIB:.2f} GiB network, {x['further_round_nvlink_bytes'] / GIB:.2f} GiB NVLink",
        ]
    if "estimate" in p:
        e = p["estimate"]
        lines += [
            "estimate (a roofline of datasheet rates, not a measurement)",
            f"  compute {e['compute_s']:.3g} s, HBM {e['memory_s']:.3g} s, NVLink {e['nvlink_s']:.3g} s, "
            f"network {e['network_s']:.3g} s",
            f"  step {e['overlapped_s']:.3g} s (all overlapped) to {e['serial_s']:.3g} s (none); "
            f"MFU {e['mfu_overlapped']:.1%} to {e['mfu_serial']:.1%}",
        ]
        t = e["schedule"]
        lines += [
            f"as scheduled: kernels {t['kernel_s']:.3g} s (each at its own roofline), communication "
            f"{t['communication_s']:.3g} s of which {t['exposed_s']:.3g} s exposed (no kernel between its start and done)",
            f"  step {t['step_s']:.3g} s with the schedule's overlap (MFU {t['mfu']:.1%}), "
            f"{t['no_overlap_s']:.3g} s with none (MFU {t['mfu_no_overlap']:.1%})",
            "  the kernels that take the most time (s a step, where):",
            *(f"    {k['seconds']:8.3f}  {k['op_name']}" for k in t["kernels"][:5]),
            "  the collectives exposed the longest (s a step, kind, result, where):",
            *(f"    {x['seconds']:8.3f}  {x['collective']}" for x in t["exposed"][:5]),
        ]
    return "\n".join(lines)
