"""Layerwise validation memory at full DeepSeek-V3 width.

Synthetic FP8 checkpoints (`converters.synthetic`) with DeepSeek-V3's widths and names (hidden
7168, 128 heads, vocab 129280, expert width 2048), one dense layer and MoE layers of 64 experts,
at 2 and 4 layers in all; `moe-jax validate --layerwise` on each, peak private memory sampled
from /proc (`moe_jax.measure`). If memory is set by the largest layer, the two peaks are the same.

    .venv/bin/python scripts/bench_validate.py --out runs/bench_validate.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from converters.synthetic import synthetic_checkpoint
from moe_jax.measure import GiB, benchmark_parser, run_sampled


def main() -> None:
    ap = benchmark_parser(__doc__, "bench_validate", workdir=True)
    ap.add_argument("--layers", default="2,4", help="total decoder layers (one dense, the rest MoE)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    results = []
    for layers in [int(x) for x in args.layers.split(",")]:
        src = args.workdir / f"src-{layers}"
        print(
            f"building a full-width FP8 checkpoint with {layers} layers ({args.experts} experts per MoE layer)",
            flush=True,
        )
        nbytes = synthetic_checkpoint(src, layers - 1, experts=args.experts, scale=(1e-5, 1e-4))
        report = args.workdir / f"report-{layers}.json"
        run = run_sampled(
            [
                sys.executable,
                "-m",
                "moe_jax.cli",
                "validate",
                "--hf",
                str(src),
                "--layerwise",
                "--dtype",
                args.dtype,
                "--tokens",
                str(args.tokens),
                "--batch",
                "1",
                "--report",
                str(report),
            ],
            check=False,
        )
        r = json.loads(report.read_text())
        results.append(
            {
                "layers": layers,
                "checkpoint_bytes": nbytes,
                **run,
                "pass": r["pass"],
                "logits": r["logits"],
                "layer_errors": [x["rel_rms"] for x in r["layers"]],
            }
        )
        print(
            f"  {layers} layers: peak private {run['peak_anon'] / GiB:.2f} GiB, {run['seconds']:.0f} s, "
            f"pass {r['pass']}",
            flush=True,
        )
        shutil.rmtree(src)
    print(
        "\n| layers | FP8 checkpoint | peak private (RssAnon) | time | pass | max layer rel. error |\n|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['layers']} | {r['checkpoint_bytes'] / 1e9:.1f} GB | {r['peak_anon'] / GiB:.2f} GiB | "
            f"{r['seconds']:.0f} s | {r['pass']} | {max(r['layer_errors']):.2e} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
