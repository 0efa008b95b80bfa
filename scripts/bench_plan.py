"""`moe-jax plan` against reality: the training step compiled for this machine's devices, its
planned per-device peak memory, then the same compiled program run once on real (zero) arrays and
its memory measured: on a GPU the device's peak bytes in use (`memory_stats`), on the CPU the
process's anonymous resident memory above what it held before the state was allocated (sampled
every 0.5 ms; run with MALLOC_MMAP_THRESHOLD_=65536, which the script sets for itself, so freed buffers
leave the resident set at once).

    .venv/bin/python scripts/bench_plan.py --config configs/tiny.yaml model.compute_dtype=float32 --out out.json
"""

from __future__ import annotations

import os
import sys

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # before anything allocates: re-exec with it
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_jax.measure import benchmark_parser, peak_during, read_rss  # noqa: E402
from moe_jax.train.config import load_config  # noqa: E402
from moe_jax.train.plan import GIB, Cluster, compile_step, plan_of  # noqa: E402


def zeros_like(tree):
    """Real arrays of `tree`'s abstract shapes on their shardings (segment ids 1: one document a row)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, a: (jnp.ones if "segment_ids" in jax.tree_util.keystr(kp) else jnp.zeros)(
            a.shape, a.dtype, device=a.sharding
        ),
        tree,
    )


def measure(c) -> dict:
    """Run the compiled step once; its peak memory per device (bytes) and how it was measured."""
    device = c.devices[0]
    numbers = jax.device_put(c.step.numbers, c.step.numbers_sharding)

    def step():
        state, batch = zeros_like(c.state), zeros_like(c.batch)
        jax.block_until_ready(c.compiled(state, batch, numbers))

    if device.platform == "gpu":
        before = device.memory_stats()["bytes_in_use"]
        step()
        return {"peak": device.memory_stats()["peak_bytes_in_use"] - before, "how": "memory_stats peak_bytes_in_use"}
    base = read_rss(os.getpid())["anon"]
    _, peak = peak_during(step)
    return {"peak": peak["anon"] - base, "how": "RssAnon above the process's before the state"}


def main() -> None:
    p = benchmark_parser(__doc__, "bench_plan")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    local = jax.devices()
    target = "cpu" if local[0].platform == "cpu" else "local"
    c = compile_step(cfg, Cluster(target, 1, 1 if cfg.mesh is None else len(local)))
    planned = plan_of(cfg, c)
    measured = measure(c)
    ratio = measured["peak"] / planned["memory"]["peak"]
    print(f"{'':24}{'GiB':>10}")
    print(f"{'planned peak':24}{planned['memory']['peak'] / GIB:10.3f}  (XLA's buffer assignment, per device)")
    print(f"{'measured peak':24}{measured['peak'] / GIB:10.3f}  ({measured['how']})")
    print(f"{'measured / planned':24}{ratio:10.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plan": planned, "measured": measured, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
