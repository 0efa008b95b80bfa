"""The README's 671B table: DeepSeek-V3 671B continued pretraining (configs/deepseek-v3-671b.yaml:
61 layers, 256 experts, MTP, 4,096 tokens a sequence, one sequence per GPU, float32 master
weights and AdamW state, bfloat16 compute) planned with `moe-jax plan` for clusters of each GPU
kind, smallest first, until one fits. No GPU is used: every row is XLA's GPU compiler run here.

    .venv/bin/python scripts/plan_671b.py --targets h100,h200,b200,gb200 --out runs/plan_671b.json

Mesh: the experts split over `expert` within one node (the inner mesh axis: 8 consecutive GPUs,
so the expert all-to-alls stay on NVLink), every weight also over `fsdp` across the nodes (all
GPUs together hold one copy of the weights and AdamW state), remat `full` (each layer's input
kept) unless --remat says otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_jax import gpu  # noqa: E402
from moe_jax.measure import benchmark_parser  # noqa: E402
from moe_jax.train.config import load_config  # noqa: E402
from moe_jax.train.plan import GIB, RUNTIME_RESERVE, Cluster, describe_plan, plan  # noqa: E402

CONFIG = "configs/deepseek-v3-671b.yaml"


def cluster_sizes(target: str) -> list[tuple[int, int]]:
    """(hosts, GPUs per host), smallest first: HGX nodes of 8, or GB200/GB300 trays of 4."""
    per_host = 4 if target.startswith("gb") else 8
    return [(n // per_host, per_host) for n in (128, 256, 512, 1024)]


def plan_one(target: str, hosts: int, per_host: int, ep: int, remat: str, backend: str | None) -> dict:
    n = hosts * per_host
    overrides = [f"mesh=fsdp={n // ep},expert={ep}", f"data.batch_size={n}", f"model.remat={remat}"]
    overrides += [f"model.backend={backend}"] if backend else []
    cfg = load_config(CONFIG, overrides)
    t = time.perf_counter()
    p = plan(cfg, Cluster(target, hosts, per_host), log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(describe_plan(p), flush=True)
    print(f"({time.perf_counter() - t:.0f} s)\n", flush=True)
    return p


def row(p: dict) -> str:
    m, e = p["memory"], p["estimate"]
    mesh = ", ".join(f"{k}={v}" for k, v in p["mesh"].items())
    verdict = "fits" if p["fits"] else f"short by {p['short_by'] / GIB:.0f} GiB"
    return (
        f"| {p['target'].upper()} | {p['devices']} | {mesh} | {p['remat']} | {p['backend'] or 'default'} | "
        f"{m['params'] / GIB:.1f} | "
        f"{m['optimizer'] / GIB:.1f} | {m['temporaries'] / GIB:.1f} | {m['peak'] / GIB:.1f} of "
        f"{p['device_memory'] / GIB:.0f} | {verdict} | {e['overlapped_s']:.1f}-{e['serial_s']:.1f} s | "
        f"{e['mfu_serial']:.0%}-{e['mfu_overlapped']:.0%} |"
    )


HEADER = (
    "| GPU | GPUs | mesh | remat | grouped GEMM | params GiB | AdamW GiB | temporaries GiB | XLA peak GiB "
    "| verdict (+3 GiB runtime) | est. step | est. MFU |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(results)), 4))
    labels = [f"{p['target'].upper()}\n{p['devices']}" for p in results]
    bottom = [0.0] * len(results)
    for key, name in (("params", "parameters"), ("optimizer", "AdamW state"), ("temporaries", "temporaries")):
        values = [p["memory"][key] / GIB for p in results]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(labels, [(p["device_memory"] - RUNTIME_RESERVE) / GIB for p in results], marker="_", s=900, c="k",
               label="device memory - 3 GiB", zorder=3)  # fmt: skip
    ax.set_ylabel("GiB per GPU")
    ax.set_title("DeepSeek-V3 671B, 4,096 tokens a row: moe-jax plan, per GPU", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = benchmark_parser(__doc__, "plan_671b")
    p.add_argument("--targets", default="h100,h200,b200,gb200")
    p.add_argument("--ep", type=int, default=8, help="GPUs the experts are split over (within a node)")
    p.add_argument("--remat", default="full")
    p.add_argument("--backend", help="grouped-GEMM backend, e.g. te+mxfp8 (Blackwell; default: the target's)")
    args = p.parse_args()
    results = []
    for target in args.targets.split(","):
        if target not in gpu.TARGETS:
            raise SystemExit(f"unknown target {target!r}; known: {', '.join(gpu.TARGETS)}")
        for hosts, per_host in cluster_sizes(target):
            results.append(plan_one(target, hosts, per_host, args.ep, args.remat, args.backend))
            if results[-1]["fits"]:
                break
    print(HEADER)
    for r in results:
        print(row(r))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
