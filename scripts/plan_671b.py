"""The 671B table: DeepSeek-V3 671B continued pretraining planned with `moe-jax plan`, one row per
target from its run config `configs/deepseek-v3-671b-<target>.yaml` (mesh, batch, accumulation,
remat and grouped-GEMM backend), on as many GPUs as its mesh holds (4 a host on GB200/GB300, 8
elsewhere). No GPU is used: every row is XLA's GPU compiler run here.

    .venv/bin/python scripts/plan_671b.py --targets gb200,b200,h200,h100 --out runs/plan_671b.json

Each row is compiled by `moe-jax plan` in a process of its own (jax's Mosaic GPU builds a
process's kernels for the first GPU architecture it compiled for), so each row is exactly

    .venv/bin/moe-jax plan --config configs/deepseek-v3-671b-<target>.yaml --target <target> \\
        --hosts N --gpus-per-host G --json ...

`--set key=value` adds overrides to every row (for example `--set model.backend=te` on Blackwell);
`--update` plans the rows of --targets again and keeps --out's other rows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_jax.files import atomic_write  # noqa: E402
from moe_jax.measure import benchmark_parser  # noqa: E402
from moe_jax.train.config import load_config  # noqa: E402
from moe_jax.train.plan import GIB, RUNTIME_RESERVE  # noqa: E402

# What NVIDIA and DeepSeek report for DeepSeek-V3 training, TFLOPS per GPU (docs/planning.md's anchors)
ANCHORS = {"gb200": 1068, "b200": 864, "h100": 338}


def bad_input(message: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"plan_671b.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def config_path(target: str) -> Path:
    return ROOT / "configs" / f"deepseek-v3-671b-{target}.yaml"


def cluster_of(target: str, overrides: list[str]) -> tuple[int, int]:
    """(hosts, GPUs a host) for the config's mesh: 4 a host on GB200/GB300 trays, 8 elsewhere."""
    cfg = load_config(config_path(target), overrides)
    size = math.prod(int(part.split("=")[1]) for part in cfg.mesh.split(","))
    per_host = 4 if target.startswith("gb") else 8
    if size % per_host:
        bad_input(f"{config_path(target)}: a mesh of {size} GPUs is not whole hosts of {per_host}")
    return size // per_host, per_host


def plan_row(target: str, overrides: list[str]) -> dict:
    """`moe-jax plan` of the target's config, in a process of its own; its JSON."""
    hosts, per_host = cluster_of(target, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "moe_jax.cli", "plan", "--config", str(config_path(target)), "--target", target,
               "--hosts", str(hosts), "--gpus-per-host", str(per_host), "--json", str(out), *overrides]  # fmt: skip
        print("$", " ".join(cmd[2:]), flush=True)
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
        print(done.stdout, end="", flush=True)
        if done.returncode:
            raise SystemExit(f"{target}: moe-jax plan failed: {done.stderr.strip().splitlines()[-1]}")
        print(f"({time.perf_counter() - t:.0f} s)\n", flush=True)
        p = json.loads(out.read_text())
    p["config"] = str(config_path(target).relative_to(ROOT))
    p["grad_accum"] = load_config(config_path(target), overrides).optim.grad_accum
    return p


def tflops_per_gpu(p: dict, key: str) -> float:
    """Model TFLOP/s a GPU at the schedule's estimated step (`key`: step_s, with its overlap, or
    no_overlap_s)."""
    return p["flops"]["model"] / p["estimate"]["schedule"][key] / 1e12


def row(p: dict) -> str:
    m, e, t = p["memory"], p["estimate"], p["estimate"]["schedule"]
    mesh = ", ".join(f"{k}={v}" for k, v in p["mesh"].items())
    verdict = "fits" if p["fits"] else f"short by {p['short_by'] / GIB:.0f} GiB"
    tokens = p["tokens_per_step"] / p["devices"]
    return (
        f"| {p['target'].upper()} | {p['devices']} | {mesh} | {p['batch'][0]} x {p['grad_accum']} | "
        f"{p['backend'] or 'default'} | {(m['params'] + m['optimizer']) / GIB:.1f} | {m['temporaries'] / GIB:.1f} | "
        f"{m['peak'] / GIB:.1f} of {p['device_memory'] / GIB:.0f} | {verdict} | "
        f"{e['overlapped_s']:.1f}-{e['serial_s']:.1f} s | {t['no_overlap_s']:.1f} / {t['step_s']:.1f} s | "
        f"{tokens / t['no_overlap_s']:,.0f} / {tokens / t['step_s']:,.0f} | "
        f"{tflops_per_gpu(p, 'no_overlap_s'):.0f} / {tflops_per_gpu(p, 'step_s'):.0f} | "
        f"{t['mfu_no_overlap']:.0%} / {t['mfu']:.0%} | {ANCHORS.get(p['target'], '')} |"
    )


HEADER = (
    "| GPU | GPUs | mesh | batch x micro-batches | grouped GEMM | params + AdamW GiB | temporaries GiB "
    "| XLA peak GiB | verdict (+3 GiB runtime) | step, roofline bounds | step as scheduled, no overlap / "
    "its overlap | tokens/s/GPU | TFLOPS/GPU | MFU | reported TFLOPS/GPU |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(results)), 4))
    labels = [f"{p['target'].upper()}\n{p['devices']}" for p in results]
    bottom = [0.0] * len(results)
    for key, name in (("params", "parameters"), ("optimizer", "AdamW state"), ("temporaries", "temporaries")):
        values = [p["memory"][key] / GIB for p in results]
        mem.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.scatter(labels, [(p["device_memory"] - RUNTIME_RESERVE) / GIB for p in results], marker="_", s=900, c="k",
                label="device memory - 3 GiB", zorder=3)  # fmt: skip
    mem.set_ylabel("GiB per GPU")
    mem.legend(fontsize=8)
    low = [tflops_per_gpu(p, "no_overlap_s") for p in results]
    high = [tflops_per_gpu(p, "step_s") for p in results]
    speed.bar(labels, high, color="tab:green", alpha=0.35, label="as scheduled, with its overlap")
    speed.bar(labels, low, color="tab:green", label="as scheduled, no overlap")
    speed.scatter(labels, [ANCHORS.get(p["target"], float("nan")) for p in results], marker="*", s=120, c="k",
                  label="reported (NVIDIA, Megatron-Bridge)", zorder=3)  # fmt: skip
    speed.set_ylabel("model TFLOPS per GPU")
    speed.legend(fontsize=8)
    fig.suptitle("DeepSeek-V3 671B, 4,096-token sequences: moe-jax plan, per GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = benchmark_parser(__doc__, "plan_671b")
    p.add_argument("--targets", default="gb200,b200,h200,h100")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every row")
    p.add_argument("--table-only", action="store_true", help="redraw the table and plot from --out, compiling nothing")
    p.add_argument("--update", action="store_true", help="plan --targets again and keep --out's other rows")
    args = p.parse_args()
    existing = args.table_only or (args.update and Path(args.out).exists())
    try:
        kept = json.loads(Path(args.out).read_text()) if existing else []
    except (OSError, ValueError) as e:
        bad_input(f"{args.out}: not a table of plan_671b.py rows to keep ({e})")
    if args.table_only:
        results = kept
    else:
        targets = args.targets.split(",")
        for target in targets:
            if not config_path(target).exists():
                bad_input(f"no run config for {target}: {config_path(target)}")
        planned = {target: plan_row(target, args.set) for target in targets}
        results = [planned.pop(r["target"], r) for r in kept] + list(planned.values())
    print(HEADER)
    for r in results:
        print(row(r))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        atomic_write(out, json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
