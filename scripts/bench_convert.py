"""Conversion memory and throughput at full DeepSeek-V3 width.

Builds synthetic FP8 checkpoints (`converters.synthetic`) with DeepSeek-V3's real widths, tensor
names, dtypes and scale shapes (hidden 7168, vocab 129280, MLA 128 heads, expert width 2048; one
dense layer and 32 experts per MoE layer so that it fits a small disk), with 1 and with 4 MoE
layers, then for each: a raw read+write of the same bytes and `moe-jax convert`, side by side,
several times.

Memory is sampled from /proc/PID/status of the converter process (`moe_jax.measure`): RssAnon
(private memory, what runs a machine out of RAM) and RssFile (mapped shard pages, reclaimable).

    .venv/bin/python scripts/bench_convert.py --workdir /tmp/bench_convert --out runs/bench_convert.json
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from converters.synthetic import full_width_config, largest_tensor_bytes, synthetic_checkpoint
from moe_jax.config import ModelConfig
from moe_jax.measure import GiB, benchmark_parser, run_sampled


def raw_copy(src: Path, dst: Path, block: int = 64 * 2**20, sync: bool = True) -> float:
    """Read every file of src and write it to dst; seconds. `sync`: fsync each file before it
    counts as written, as the converter must (its output is on disk before it is committed);
    without it the copy only fills the page cache and is timed before the disk has the data."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    for f in sorted(src.iterdir()):
        with open(f, "rb") as fin, open(dst / f.name, "wb") as fout:
            while chunk := fin.read(block):
                fout.write(chunk)
            if sync:
                fout.flush()
                os.fsync(fout.fileno())
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return seconds


def raw_read(root: Path, block: int = 16 * 2**20) -> float:
    """Read every file below root (what verifying must at least do); seconds."""
    t0 = time.perf_counter()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fin:
            while fin.read(block):
                pass
    return time.perf_counter() - t0


def main() -> None:
    ap = benchmark_parser(__doc__, "bench_convert", workdir=True)
    ap.add_argument("--moe-layers", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = []
    for layers in [int(x) for x in args.moe_layers.split(",")]:
        src, dst = args.workdir / f"src-{layers}", args.workdir / f"dst-{layers}"
        print(f"building synthetic FP8 checkpoint with {layers} MoE layer(s) ...", flush=True)
        nbytes = synthetic_checkpoint(src, layers)
        runs = []
        for r in range(args.repeats):
            raw = raw_copy(src, args.workdir / "rawcopy")
            conv = run_sampled(
                [sys.executable, "-m", "moe_jax.cli", "convert", "--from", "hf", str(src), "--to", str(dst), "--force"]
            )
            unsynced = raw_copy(src, args.workdir / "rawcopy", sync=False)
            # integrity: `moe-jax verify` reads and checksums every file of the output, beside a
            # plain read of the same files (both from the page cache the convert left)
            read_out = raw_read(dst)
            out_bytes = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
            check = run_sampled([sys.executable, "-m", "moe_jax.cli", "verify", str(dst)])
            verify_s = float(check["stdout"].rsplit("(", 1)[1].split(" s)")[0])  # its own timing, no start-up
            runs.append(
                {
                    "raw_seconds": raw,
                    **conv,
                    "ratio": raw / conv["seconds"],
                    "raw_unsynced_seconds": unsynced,
                    "ratio_vs_unsynced": unsynced / conv["seconds"],
                    "verify_seconds": verify_s,
                    "read_output_seconds": read_out,
                    "output_bytes": out_bytes,
                }
            )
            print(
                f"  run {r}: raw {nbytes / raw / 1e9:.2f} GB/s (unsynced {nbytes / unsynced / 1e9:.2f}), "
                f"convert {nbytes / conv['seconds'] / 1e9:.2f} GB/s, "
                f"peak anon {conv['peak_anon'] / GiB:.2f} GiB, file {conv['peak_file'] / GiB:.2f} GiB",
                flush=True,
            )
        largest = largest_tensor_bytes(ModelConfig.from_hf_dict(full_width_config(layers)))
        results.append(
            {
                "moe_layers": layers,
                "input_bytes": nbytes,
                "largest_tensor_bytes": largest,
                "output_bytes": sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()),
                "convert_bytes_per_s": statistics.median(nbytes / r["seconds"] for r in runs),
                "raw_bytes_per_s": statistics.median(nbytes / r["raw_seconds"] for r in runs),
                "throughput_ratio": statistics.median(r["ratio"] for r in runs),
                "raw_unsynced_bytes_per_s": statistics.median(nbytes / r["raw_unsynced_seconds"] for r in runs),
                "throughput_ratio_vs_unsynced": statistics.median(r["ratio_vs_unsynced"] for r in runs),
                "peak_anon": max(r["peak_anon"] for r in runs),
                "peak_file": max(r["peak_file"] for r in runs),
                "target_anon": 2 * GiB + 2 * largest,
                "runs": runs,
                "verify_bytes_per_s": statistics.median(r["output_bytes"] / r["verify_seconds"] for r in runs),
                "read_output_bytes_per_s": statistics.median(
                    r["output_bytes"] / r["read_output_seconds"] for r in runs
                ),
                "verify_vs_convert": statistics.median(r["verify_seconds"] / r["seconds"] for r in runs),
            }
        )
        shutil.rmtree(src)
        shutil.rmtree(dst)
    print(
        "\n| MoE layers | FP8 input | BF16 output | convert | raw read+write (fsync) | ratio | peak private (RssAnon) "
        "| peak mapped (RssFile) | target private |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['moe_layers']} | {r['input_bytes'] / 1e9:.2f} GB | {r['output_bytes'] / 1e9:.2f} GB | "
            f"{r['convert_bytes_per_s'] / 1e6:.0f} MB/s | {r['raw_bytes_per_s'] / 1e6:.0f} MB/s | "
            f"{r['throughput_ratio']:.2f} | {r['peak_anon'] / GiB:.2f} GiB | "
            f"{r['peak_file'] / GiB:.2f} GiB | < {r['target_anon'] / GiB:.2f} GiB |"
        )
    for r in results:
        print(
            f"{r['moe_layers']} MoE layer(s): raw copy without fsync {r['raw_unsynced_bytes_per_s'] / 1e6:.0f} MB/s, "
            f"ratio to it {r['throughput_ratio_vs_unsynced']:.2f}; per-run ratios "
            + ", ".join(f"{x['ratio']:.2f}" for x in r["runs"])
        )
    print("\n| MoE layers | output | moe-jax verify | plain read of the same files | verify / convert time |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['moe_layers']} | {r['output_bytes'] / 1e9:.2f} GB | {r['verify_bytes_per_s'] / 1e9:.2f} GB/s | "
            f"{r['read_output_bytes_per_s'] / 1e9:.2f} GB/s | {r['verify_vs_convert']:.2f} |"
        )
    if len(results) > 1:
        growth = results[-1]["peak_anon"] / results[0]["peak_anon"] - 1
        print(
            f"private-memory growth from {results[0]['moe_layers']} to {results[-1]['moe_layers']} MoE layers: {growth:+.1%}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
