"""Expert-parallel dispatch: bytes moved per token, and step time on 8 CPU devices vs 1.

Part 1, routing statistics. DeepSeek-V3's routing (256 experts, top-8, 8 groups of 32, 4 groups
kept, noaux_tc) computed by our own `moe_jax.moe.route` on random tokens and random router
weights: SYNTHETIC routings that follow DeepSeek's node-limited rule, not measured router traces.
Regimes: a random router ("uniform"), the same plus a Zipf-shaped correction bias that makes a
few experts popular ("zipf"), and both again without the group limit (topk_group = n_group).
For EP 8/16/32/64, rows (one token's hidden vector to one rank) and bytes per token:
  naive        one copy per chosen expert (k = 8 rows);
  dedup        the rows our `dispatch_plan` marks in `send`, counted from its output;
  lower bound  distinct destination ranks of the token's experts, computed in numpy.
The script fails unless dedup == lower bound exactly, per token. Combine sends one reduced row
back per dispatched row.

Part 2, step time: a small DeepSeek-V3-shaped model, jitted forward+backward of the
cross-entropy, on meshes `expert=8` and `data=2,expert=4` of 8 forced CPU devices vs one device
(no mesh), same global batch, medians after warm-up. Run in subprocesses (the device count must
be set before jax starts).

    .venv/bin/python scripts/bench_ep.py --json runs/bench_ep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.model import forward, model_from_tree
from moe_jax.moe import route
from moe_jax.parallel.ep import ExpertParallel, default_transport, dispatch_plan, ranks_per_token
from moe_jax.params import init_tree
from moe_jax.sharding import mesh_from_spec

# DeepSeek-V3's routing (256 experts, top-8 within 4 of 8 groups, one shared expert); the hidden
# size only sets the router's input width here.
# fmt: off
ROUTING_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=16, num_hidden_layers=1, first_k_dense_replace=0,
    hidden_size=256, intermediate_size=64, moe_intermediate_size=64,
    num_attention_heads=1, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True,
)

# The model timed in part 2: DeepSeek-V3's shape of routing (8 groups, 4 kept, top-8), small widths.
STEP_MODEL_CONFIG = {
    **ROUTING_CONFIG, "vocab_size": 1024, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 64,
}
# fmt: on

SYNTHETIC_NOTE = (
    "SYNTHETIC routings: DeepSeek-V3's routing rule (noaux_tc, node-limited to topk_group groups) computed by "
    "moe_jax.moe.route on random N(0,1) tokens and a random N(0,1/hidden) router; no real DeepSeek-V3 router "
    "logits were used. These are not measured router traces."
)


# ---- part 1: routing statistics ----------------------------------------------------------------
def make_routings(tokens: int, zipf_alpha: float, seed: int = 0) -> list[dict]:
    """Routings (numpy experts [T, k]) per regime, from the real routing function."""
    rng = np.random.default_rng(seed)
    limited = ModelConfig.from_hf_dict(ROUTING_CONFIG)
    unlimited = ModelConfig.from_hf_dict({**ROUTING_CONFIG, "topk_group": ROUTING_CONFIG["n_group"]})
    e, h = limited.n_routed_experts, limited.hidden_size
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((h, e)) / np.sqrt(h), jnp.float32)  # logits ~ N(0, 1)
    # Zipf popularity 1/rank over a random permutation of the experts, as a correction bias
    # (added to the sigmoid scores for the choice only, as the real e_score_correction_bias).
    popularity_rank = rng.permutation(e) + 1
    zipf_bias = zipf_alpha * np.log(1.0 / popularity_rank)
    zipf_bias -= zipf_bias.mean()
    biases = {"uniform": np.zeros(e), "zipf": zipf_bias, "worst": np.where(np.arange(e) < 8, 10.0, 0.0)}
    out = []
    for cfg, suffix in ((limited, ""), (unlimited, "_nolimit")):
        for name, bias in biases.items():
            if name == "worst" and suffix:
                continue
            r = route(x, router, jnp.asarray(bias, jnp.float32), cfg)
            out.append(
                {
                    "name": name + suffix,
                    "topk_group": cfg.topk_group,
                    "n_group": cfg.n_group,
                    "bias": {
                        "uniform": "zero",
                        "zipf": f"{zipf_alpha} * log(1/popularity_rank), centred",
                        "worst": "+10 on experts 0-7: every token to the same 8 experts (one rank at EP 8)",
                    }[name],
                    "experts": r.experts,
                    "weights": r.weights,
                    "cfg": cfg,
                }
            )
    return out


def distinct_per_row(a: np.ndarray) -> np.ndarray:
    """Number of distinct values in each row of an int array [T, k]."""
    s = np.sort(a, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)


CAPACITIES = (1.0, 1.25, 1.5, 2.0)


def ep_stats(experts, weights, ep: int, num_experts: int, row_bytes: int, cfg: ModelConfig) -> dict:
    """Rows and bytes per token for one EP size. Dedup rows are counted from `dispatch_plan`'s
    `send`; the lower bound is computed independently from the expert ids; the analytic figure
    for balanced routing is `ranks_per_token`. Loads: (token, expert) pairs each rank receives,
    and rows each node of 8 ranks receives (the hierarchical exchange's first stage), over their
    balanced mean: the bounded exchange takes further rounds where this exceeds the capacity."""
    per_rank = num_experts // ep
    send, local_ids, local_weights = dispatch_plan(experts, weights, ep, per_rank)
    send, local_ids = np.asarray(send), np.asarray(local_ids)  # [EP, T], [EP, T, k]
    ex = np.asarray(experts)
    t, k = ex.shape

    # every (token, expert) choice arrives on the rank that holds it: nothing dropped
    naive_rows = int((local_ids >= 0).sum())
    if naive_rows != t * k:
        raise AssertionError(f"EP={ep}: dispatch_plan carries {naive_rows} choices, expected {t * k}")
    dedup_per_token = send.sum(axis=0)  # [T]
    ranks = ex // per_rank  # [T, k], numpy, independent of dispatch_plan
    lower_per_token = distinct_per_row(ranks)
    if not np.array_equal(dedup_per_token, lower_per_token):
        bad = int((dedup_per_token != lower_per_token).sum())
        raise AssertionError(
            f"EP={ep}: dedup rows differ from the distinct-rank lower bound on {bad} tokens "
            f"({int(dedup_per_token.sum())} vs {int(lower_per_token.sum())} rows)"
        )

    # remote only: token t lives on rank t // (T/EP) (contiguous blocks, as ep_moe's shard_map splits tokens)
    home = np.arange(t) // (t // ep)
    naive_remote = int((ranks != home[:, None]).sum())
    dedup_remote = int(send.sum() - send[home, np.arange(t)].sum())
    lower_remote = int(lower_per_token.sum() - (ranks == home[:, None]).any(axis=1).sum())
    if dedup_remote != lower_remote:
        raise AssertionError(f"EP={ep}: remote dedup rows {dedup_remote} != remote lower bound {lower_remote}")

    # metadata as our dispatch sends it: per row, k local ids and k weights (-1 / 0 where not on that rank);
    # naive: one expert id (int32) and one weight (float32) per copy (assumed, no naive code to count from)
    meta_row = local_ids.shape[-1] * (local_ids.dtype.itemsize + np.asarray(local_weights).dtype.itemsize)
    meta_naive_row = 4 + 4
    naive, dedup, lower = t * k, int(dedup_per_token.sum()), int(lower_per_token.sum())
    hist = np.bincount(lower_per_token, minlength=k + 1)
    return {
        "ep": ep,
        "experts_per_rank": per_rank,
        "tokens": t,
        "rows_total": {"naive": naive, "dedup": dedup, "lower_bound": lower},
        "rows_per_token": {"naive": naive / t, "dedup": dedup / t, "lower_bound": lower / t},
        "remote_rows_per_token": {
            "naive": naive_remote / t,
            "dedup": dedup_remote / t,
            "lower_bound": lower_remote / t,
        },
        "dedup_equals_lower_bound": dedup == lower and dedup_remote == lower_remote,
        "reduction_naive_over_dedup": naive / dedup,
        "remote_reduction_naive_over_dedup": naive_remote / max(dedup_remote, 1),
        "ranks_per_token_mean": float(lower_per_token.mean()),
        "ranks_per_token_max": int(lower_per_token.max()),
        "ranks_per_token_hist": {str(i): int(c) for i, c in enumerate(hist) if c},
        "dispatch_hidden_bytes_per_token": {
            "naive": naive * row_bytes / t,
            "dedup": dedup * row_bytes / t,
            "lower_bound": lower * row_bytes / t,
        },
        "dispatch_metadata_bytes_per_token": {"naive": naive * meta_naive_row / t, "dedup": dedup * meta_row / t},
        "combine_bytes_per_token": {"naive": naive * row_bytes / t, "dedup": dedup * row_bytes / t},
        "remote_dispatch_hidden_bytes_per_token": {
            "naive": naive_remote * row_bytes / t,
            "dedup": dedup_remote * row_bytes / t,
        },
        # what ep_moe's transport="all_to_all" (the CPU default) moves: a fixed [EP, T, H] buffer, unmarked rows zero
        "fixed_buffer_rows_per_token": send.shape[0],
        "ranks_per_token_analytic": ranks_per_token(cfg, ep),
        "measured_over_analytic": float(lower_per_token.mean()) / ranks_per_token(cfg, ep),
        **loads(ranks, ep, k),
    }


def loads(ranks: np.ndarray, ep: int, k: int, per_node: int = 8) -> dict:
    """Receive loads over their balanced mean, and the further rounds they imply per capacity
    (a receiver whose load is L x its budget needs ceil(L) rounds; senders rarely bind first)."""
    t = ranks.shape[0]
    pairs = np.bincount(ranks.ravel(), minlength=ep) / (t * k / ep)  # (token, expert) pairs per rank
    out = {"rank_pairs_max_over_mean": float(pairs.max())}
    if ep > per_node:
        nodes = ep // per_node
        node_rows = np.zeros(nodes)
        for n in range(nodes):  # tokens reaching node n, once each
            node_rows[n] = (ranks // per_node == n).any(axis=1).sum()
        out["node_rows_max_over_mean"] = float(node_rows.max() / node_rows.mean())
    worst = max(out.values())
    out["further_rounds"] = {str(c): max(int(np.ceil(worst / c)) - 1, 0) for c in CAPACITIES}
    return out


def routing_report(args) -> list[dict]:
    row_bytes = args.hidden * args.bytes_per_value
    regimes = []
    for reg in make_routings(args.tokens, args.zipf_alpha):
        cfg, ex = reg.pop("cfg"), np.asarray(reg["experts"])
        e, per_group = cfg.n_routed_experts, cfg.n_routed_experts // cfg.n_group
        groups = distinct_per_row(ex // per_group)
        if groups.max() > cfg.topk_group:
            raise AssertionError(f"{reg['name']}: a token uses {groups.max()} groups > topk_group={cfg.topk_group}")
        load = np.bincount(ex.ravel(), minlength=e)
        reg["expert_load_max_over_mean"] = float(load.max() / load.mean())
        reg["top8_experts_share"] = float(np.sort(load)[::-1][:8].sum() / load.sum())
        reg["unused_experts"] = int((load == 0).sum())
        reg["groups_per_token_mean"] = float(groups.mean())
        reg["groups_per_token_max"] = int(groups.max())
        reg["ep"] = [ep_stats(reg["experts"], reg["weights"], ep, e, row_bytes, cfg) for ep in args.ep]
        for s in reg["ep"]:  # whole groups per rank: a token reaches at most topk_group ranks
            if s["experts_per_rank"] % per_group == 0 and s["ranks_per_token_max"] > cfg.topk_group:
                raise AssertionError(f"{reg['name']} EP={s['ep']}: a token reaches {s['ranks_per_token_max']} ranks")
        del reg["experts"], reg["weights"]
        regimes.append(reg)
        print(f"routed {reg['name']}: {args.tokens} tokens", flush=True)
    return regimes


# ---- part 2: step time -------------------------------------------------------------------------
def step_worker(specs: list[str], batch: int, seq: int, repeats: int) -> list[dict]:
    """Time a jitted forward+backward (cross-entropy) per mesh spec ("none": one device, no mesh)."""
    cfg = ModelConfig.from_hf_dict(STEP_MODEL_CONFIG)
    tree = init_tree(cfg, seed=0, mtp=False)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    rows, ref_grads = [], None
    for spec in specs:
        mesh = None if spec == "none" else mesh_from_spec(spec)
        model = model_from_tree(cfg, tree, mesh=mesh)  # no mesh: everything on the default device

        def loss(params, model=model, mesh=mesh):
            logits = forward(params, model.buffers, x, cfg, mesh=mesh).logits
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1).mean()

        step = jax.jit(jax.value_and_grad(loss))
        t0 = time.perf_counter()
        value, grads = jax.block_until_ready(step(model.params))  # compile and warm up
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(step(model.params))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(model.params))
            times.append(time.perf_counter() - t0)
        grads = jax.tree.map(np.asarray, grads)
        if ref_grads is None:
            ref_grads = grads
        diff = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
        rows.append(
            {
                "mesh": spec,
                "devices": 1 if mesh is None else int(mesh.devices.size),
                "step_s": statistics.median(times),
                "step_s_all": times,
                "first_call_s": compile_s,
                "loss": float(value),
                "max_abs_grad_diff_vs_first": diff,
            }
        )
    return rows


def run_step_worker(specs: list[str], devices: int | None, args) -> dict:
    """Run `step_worker` in a subprocess; `devices` forces that many CPU devices (None: default)."""
    env = dict(os.environ)
    if devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    cmd = [
        sys.executable,
        __file__,
        "--step-worker",
        ";".join(specs),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"step-time worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_report(args) -> dict:
    meshes = ["none", "expert=8"] if args.quick else ["none", "expert=8", "data=2,expert=4"]
    forced_run = run_step_worker(meshes, 8, args)
    forced = forced_run["rows"]
    forced[0]["mesh"] = "none (device 0 of 8 forced)"
    if args.quick:  # the test: no separate one-device process
        single, rows = forced[0], forced
    else:
        single = run_step_worker(["none"], None, args)["rows"][0]
        single["mesh"] = "none (own process, 1 CPU device)"
        single["max_abs_grad_diff_vs_first"] = None  # the 1-device run of the 8-device process is the reference
        rows = [single] + forced
    for r in rows:
        r["vs_single"] = r["step_s"] / single["step_s"]
    return {
        "model": STEP_MODEL_CONFIG,
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
        "rows": rows,
        "transport": forced_run["transport"],
        "note": f"8 forced CPU devices share this machine's {os.cpu_count()} cores: the 8-device runs measure "
        "the overhead of expert parallelism (exchange, fixed buffers, partitioning), not a speedup.",
    }


# ---- part 3: the MoE layer at DeepSeek-V3 width, compiled for GPU clusters without them ---------
# (target, hosts, GPUs per host, mesh, dispatch payload, the backward's gradient payload): EP=64 over
# 8 H100 nodes, hierarchical and flat, with bf16 dispatch, FP8 dispatch, and FP8 both ways (as the
# HGX 671B configs run); EP=64 inside one GB200 NVL72 rack (16 hosts of 4, one NVLink domain).
DEVICELESS = [
    ("h100", 8, 8, "expert_node=8,expert=8", "bfloat16", "bfloat16"),
    ("h100", 8, 8, "expert_node=8,expert=8", "float8", "bfloat16"),
    ("h100", 8, 8, "expert_node=8,expert=8", "float8", "float8"),
    ("h100", 8, 8, "expert=64", "bfloat16", "bfloat16"),
    ("gb200", 16, 4, "expert=64", "bfloat16", "bfloat16"),
]


def deviceless_worker(
    target: str, hosts: int, per_host: int, spec: str, dispatch: str, gradient: str, tokens: int, capacity: float
):
    """One MoE layer (DeepSeek-V3: hidden 7168, 256 experts, top-8 of 4 groups), forward and
    backward, `tokens` tokens a GPU, compiled for the deviceless cluster: its temporaries, and the
    bytes its exchange (the ragged all-to-alls) sends per token over the network and NVLink (its
    overflow loop counted 0 times: none in the common case), against the analytic figures for
    balanced routing."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_jax import gpu
    from moe_jax.hlo import collectives
    from moe_jax.parallel.ep import ExpertParallel, ep_moe, exchange_bytes_per_row, expert_axes, rows_per_token

    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    topo = gpu.topology(target, hosts, per_host)
    shape = {name: int(size) for name, size in (part.split("=") for part in spec.split(","))}
    mesh = gpu.deviceless_mesh(topo, shape)
    axes = expert_axes(mesh)
    h, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    options = ExpertParallel(capacity=capacity, dispatch=dispatch, gradient_dispatch=gradient)

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    experts = {
        k: arg(s, jnp.bfloat16, P(axes)) for k, s in (("gate", (e, h, i)), ("up", (e, h, i)), ("down", (e, i, h)))
    }
    params = {"router": arg((h, e), jnp.float32, P()), "experts": experts}
    bias, x = arg((e,), jnp.float32, P()), arg((mesh.size * tokens, h), jnp.bfloat16, P(tuple(shape)))
    layer = gpu.forward_backward(lambda p, b, x: ep_moe(p, b, x, cfg, mesh, options=options)[0], (0, 2))
    t0 = time.perf_counter()
    with gpu.compiling_for(topo.devices):
        compiled = jax.jit(layer).lower(params, bias, x).compile()
    seconds = time.perf_counter() - t0
    domain = gpu.TARGETS[target].nvlink_domain
    sent = collectives(compiled.as_text(), domain).get("ragged-all-to-all", {})
    rows = rows_per_token(cfg, mesh, domain)
    per_row = exchange_bytes_per_row(cfg, options, None, 2)
    return {
        "target": target,
        "hosts": hosts,
        "gpus_per_host": per_host,
        "mesh": shape,
        "dispatch": dispatch,
        "gradient_dispatch": gradient,
        "capacity": capacity,
        "tokens_per_gpu": tokens,
        "compile_s": seconds,
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "network_bytes_per_token": sent.get("network_bytes", 0.0) / tokens,
        "nvlink_bytes_per_token": sent.get("nvlink_bytes", 0.0) / tokens,
        "analytic_rows_per_token": rows,
        "analytic_network_bytes_per_token": rows["network"] * per_row,
        "analytic_nvlink_bytes_per_token": rows["nvlink"] * per_row,
    }


def deviceless_report(args) -> list[dict]:
    """Each configuration compiled in its own process (a process compiles for one GPU target)."""
    out = []
    for target, hosts, per_host, spec, dispatch, gradient in DEVICELESS:
        fields = f"{target};{hosts};{per_host};{spec};{dispatch};{gradient}"
        cmd = [sys.executable, __file__, "--deviceless-worker", fields]
        cmd += ["--gpu-tokens", str(args.gpu_tokens), "--capacity", str(args.capacity)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode != 0:
            raise RuntimeError(f"deviceless worker {target} {spec} failed:\n{proc.stderr[-4000:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = out[-1]
        print(
            f"compiled {target} {spec} {dispatch} / {gradient}: {r['temp_bytes'] / 2**30:.2f} GiB ({r['compile_s']:.0f} s)",
            flush=True,
        )
    return out


# ---- output ------------------------------------------------------------------------------------
def print_tables(result: dict) -> None:
    a = result["args"]
    row_bytes = a["hidden"] * a["bytes_per_value"]
    print(f"\n{SYNTHETIC_NOTE}")
    print(
        f"routing: {a['tokens']} tokens per regime, 256 experts, top-8, 8 groups of 32, topk_group 4 "
        "(8 in the _nolimit regimes)"
    )
    print("\n| regime | expert load max/mean | top-8 experts' share | unused experts | groups/token mean | max |")
    print("|---|---|---|---|---|---|")
    for g in result["regimes"]:
        print(
            f"| {g['name']} | {g['expert_load_max_over_mean']:.2f} | {g['top8_experts_share']:.3f} | "
            f"{g['unused_experts']} | {g['groups_per_token_mean']:.2f} | {g['groups_per_token_max']} |"
        )

    print(
        "\nrows per token (one row = one token's hidden vector sent to one rank). dedup: rows marked in "
        "dispatch_plan's `send`; lower bound: distinct destination ranks (numpy). remote: rows leaving the "
        "token's own rank (token t on rank t // (T/EP), contiguous blocks as ep_moe splits tokens)."
    )
    print(
        "\n| regime | EP | experts/rank | naive | dedup | lower bound (= mean ranks/token) | dedup == LB | "
        "naive/dedup | ranks/token max | remote naive | remote dedup | remote naive/dedup | "
        "ranks/token histogram |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g in result["regimes"]:
        for s in g["ep"]:
            r, rr = s["rows_per_token"], s["remote_rows_per_token"]
            hist = " ".join(f"{n}:{c / s['tokens']:.1%}" for n, c in s["ranks_per_token_hist"].items())
            print(
                f"| {g['name']} | {s['ep']} | {s['experts_per_rank']} | {r['naive']:.0f} | {r['dedup']:.3f} | "
                f"{r['lower_bound']:.3f} | {'yes' if s['dedup_equals_lower_bound'] else 'NO'} | "
                f"{s['reduction_naive_over_dedup']:.2f}x | {s['ranks_per_token_max']} | {rr['naive']:.3f} | "
                f"{rr['dedup']:.3f} | {s['remote_reduction_naive_over_dedup']:.2f}x | {hist} |"
            )

    print(
        f"\nbytes per token: hidden {a['hidden']} x {a['bytes_per_value']} B = {row_bytes} B per row; KiB = 1024 B. "
        "Metadata counted separately: dedup as our dispatch sends it (k int32 local ids + k float32 weights per "
        "row); naive assumed 1 int32 id + 1 float32 weight per copy. Combine: one reduced row back per "
        "dispatched row (naive: one per expert), no metadata."
    )
    print(
        "\n| regime | EP | dispatch naive KiB | dispatch dedup KiB | lower bound KiB | metadata naive B | "
        "metadata dedup B | combine naive KiB | combine dedup KiB | remote dispatch naive KiB | "
        "remote dispatch dedup KiB | fixed-buffer rows/token |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    kib = 1024
    for g in result["regimes"]:
        for s in g["ep"]:
            d, m = s["dispatch_hidden_bytes_per_token"], s["dispatch_metadata_bytes_per_token"]
            c, rd = s["combine_bytes_per_token"], s["remote_dispatch_hidden_bytes_per_token"]
            print(
                f"| {g['name']} | {s['ep']} | {d['naive'] / kib:.1f} | {d['dedup'] / kib:.2f} | "
                f"{d['lower_bound'] / kib:.2f} | {m['naive']:.0f} | {m['dedup']:.1f} | {c['naive'] / kib:.1f} | "
                f"{c['dedup'] / kib:.2f} | {rd['naive'] / kib:.2f} | {rd['dedup'] / kib:.2f} | "
                f"{s['fixed_buffer_rows_per_token']} |"
            )
    print(
        'fixed-buffer rows/token: ep_moe\'s transport="all_to_all" (the default on CPU, where ragged_all_to_all '
        "does not compile) moves a fixed [EP, T, H] buffer: EP rows per token, the unmarked ones zero-filled. "
        'The dedup columns count the rows that carry a token: what transport="ragged" (GPU/TPU default) moves, '
        "its send sizes being the row sums of the same `send`."
    )

    print(
        "\nbounded buffers: ranks per token measured (dedup) against the analytic figure for balanced routing "
        "(moe_jax.parallel.ep.ranks_per_token); receive loads over their balanced mean, per rank in (token, expert) "
        "pairs and, from EP 16, per node of 8 ranks in rows (the hierarchical exchange's network stage); the "
        "further rounds a layer takes at each capacity (model.ep_capacity) follow from the larger."
    )
    caps = " | ".join(f"rounds at {c}" for c in CAPACITIES)
    print(
        f"\n| regime | EP | ranks/token measured | analytic | measured/analytic | rank load max/mean | node load max/mean | {caps} |"
    )
    print("|---|---|---|---|---|---|---|" + "---|" * len(CAPACITIES))
    for g in result["regimes"]:
        for s in g["ep"]:
            node = s.get("node_rows_max_over_mean")
            rounds = " | ".join(str(s["further_rounds"][str(c)]) for c in CAPACITIES)
            print(
                f"| {g['name']} | {s['ep']} | {s['ranks_per_token_mean']:.3f} | {s['ranks_per_token_analytic']:.3f} | "
                f"{s['measured_over_analytic']:.3f} | {s['rank_pairs_max_over_mean']:.2f} | "
                f"{'-' if node is None else f'{node:.2f}'} | {rounds} |"
            )

    by_name = {g["name"]: g for g in result["regimes"]}
    for name in ("uniform", "zipf"):
        lim, free = by_name.get(name), by_name.get(name + "_nolimit")
        s8 = lim and next((s for s in lim["ep"] if s["ep"] == 8), None)
        f8 = free and next((s for s in free["ep"] if s["ep"] == 8), None)
        if s8 and f8:
            more = f8["rows_per_token"]["dedup"] / s8["rows_per_token"]["dedup"]
            print(
                f"node-limited routing ({name}), EP=8 (one group of 32 experts per rank): ranks per token mean "
                f"{s8['ranks_per_token_mean']:.3f}, max {s8['ranks_per_token_max']} with topk_group="
                f"{lim['topk_group']}; mean {f8['ranks_per_token_mean']:.3f}, max {f8['ranks_per_token_max']} "
                f"without the limit (dispatch rows x{more:.2f})"
            )

    st = result["step_time"]
    print(
        f"\nstep time: jitted forward+backward of the cross-entropy, global batch {st['batch']} x {st['seq']} "
        f"tokens, model {st['model']['num_hidden_layers']} layers (1 dense), hidden {st['model']['hidden_size']}, "
        f"{st['model']['n_routed_experts']} experts top-{st['model']['num_experts_per_tok']}, "
        f"{st['model']['n_group']} groups / {st['model']['topk_group']} kept; "
        f"median of {st['repeats']} after warm-up; expert-parallel transport {st['transport']!r}"
    )
    print("\n| mesh | devices | step ms | vs 1 device (own process) | first call s | loss | max abs grad diff |")
    print("|---|---|---|---|---|---|---|")
    for r in st["rows"]:
        diff = "-" if r["max_abs_grad_diff_vs_first"] is None else f"{r['max_abs_grad_diff_vs_first']:.1e}"
        print(
            f"| {r['mesh']} | {r['devices']} | {r['step_s'] * 1e3:.1f} | {r['vs_single']:.2f}x | "
            f"{r['first_call_s']:.1f} | {r['loss']:.6f} | {diff} |"
        )
    print(st["note"])
    print(
        "grad diff: largest |difference| of any gradient entry against the 1-device run of the same process; "
        "first call: compile plus one step."
    )
    if result.get("deviceless"):
        print(
            "\nthe MoE layer at DeepSeek-V3 width (hidden 7168, 256 experts, top-8 of 4 groups), forward and backward, "
            f"{result['deviceless'][0]['tokens_per_gpu']} tokens a GPU, capacity {result['deviceless'][0]['capacity']}, "
            "compiled deviceless; KiB per token the ragged all-to-alls send (overflow rounds counted 0) against the "
            "analytic figure for balanced routing (rows_per_token x exchange_bytes_per_row)"
        )
        print(
            "\n| target | GPUs | mesh | dispatch / gradients | temporaries GiB | network KiB | analytic | ratio | NVLink KiB | analytic | ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result["deviceless"]:
            net, nvl = r["analytic_network_bytes_per_token"], r["analytic_nvlink_bytes_per_token"]
            ratio = lambda got, want: f"{got / want:.2f}x" if want else "-"  # noqa: E731
            print(
                f"| {r['target']} | {r['hosts']} x {r['gpus_per_host']} | "
                f"{', '.join(f'{k}={v}' for k, v in r['mesh'].items())} | {r['dispatch']} / {r['gradient_dispatch']} | "
                f"{r['temp_bytes'] / 2**30:.2f} | {r['network_bytes_per_token'] / 1024:.1f} | {net / 1024:.1f} | "
                f"{ratio(r['network_bytes_per_token'], net)} | {r['nvlink_bytes_per_token'] / 1024:.1f} | "
                f"{nvl / 1024:.1f} | {ratio(r['nvlink_bytes_per_token'], nvl)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens routed per regime")
    ap.add_argument("--ep", default="8,16,32,64", help="expert-parallel sizes")
    ap.add_argument("--hidden", type=int, default=DEEPSEEK_V3["hidden_size"], help="hidden size, for bytes per row")
    ap.add_argument("--bytes-per-value", type=int, default=2, help="2: BF16 activations")
    ap.add_argument("--zipf-alpha", type=float, default=0.05, help="scale of the Zipf-shaped correction bias")
    ap.add_argument("--batch", type=int, default=8, help="step time: global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256, help="step time: tokens per sequence")
    ap.add_argument("--repeats", type=int, default=10, help="step time: timed repeats (median)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for the test")
    ap.add_argument("--deviceless", action="store_true", help="also compile the layer at DeepSeek-V3 width (minutes)")
    ap.add_argument("--gpu-tokens", type=int, default=4096, help="deviceless: tokens per GPU")
    ap.add_argument("--capacity", type=float, default=ExpertParallel.capacity, help="deviceless: model.ep_capacity")
    ap.add_argument("--deviceless-worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--step-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.deviceless_worker:
        target, hosts, per_host, spec, dispatch, gradient = args.deviceless_worker.split(";")
        row = deviceless_worker(
            target, int(hosts), int(per_host), spec, dispatch, gradient, args.gpu_tokens, args.capacity
        )
        print(json.dumps(row))
        return
    if args.step_worker:
        rows = step_worker(args.step_worker.split(";"), args.batch, args.seq, args.repeats)
        print(json.dumps({"rows": rows, "transport": default_transport()}))
        return
    if args.quick:
        args.tokens, args.batch, args.seq, args.repeats = 2048, 8, 32, 3
    args.ep = [int(e) for e in str(args.ep).split(",")]

    t0 = time.perf_counter()
    result = {"args": vars(args), "note": SYNTHETIC_NOTE, "routing_config": ROUTING_CONFIG}
    result["regimes"] = routing_report(args)
    result["step_time"] = step_report(args)
    if args.deviceless:
        result["deviceless"] = deviceless_report(args)
    result["runtime_s"] = time.perf_counter() - t0
    print_tables(result)
    print(f"\nruntime {result['runtime_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
