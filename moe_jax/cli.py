"""`moe-jax` command line. Bad input: one line on stderr naming the file/tensor, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EXIT_FAIL = 1  # ran, but the check failed
EXIT_BAD_INPUT = 2


def _cmd_make_tiny(args) -> int:
    from converters.tiny import make_tiny

    out = make_tiny(args.out, args.variant, fp8_weights=args.fp8, dtype=args.dtype, shards=args.shards, seed=args.seed)
    print(f"wrote tiny DeepSeek-V3 checkpoint ({args.variant}{', fp8' if args.fp8 else ''}) to {out}")
    return 0


def _cmd_convert(args) -> int:
    from converters.convert import convert_hf

    t0 = time.perf_counter()
    manifest = convert_hf(
        args.src, args.to, dtype=args.dtype, mtp=not args.no_mtp, force=args.force, workers=args.workers
    )
    n = len(manifest["tensors"])
    print(f"converted {n} tensors from {args.src} to {args.to} ({manifest['dtype']}, "
          f"MTP {'yes' if manifest['mtp'] else 'no'}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_export(args) -> int:
    from converters.export import export_hf, parse_size

    t0 = time.perf_counter()
    out = export_hf(args.src, args.to, dtype=args.dtype, shard_size=parse_size(args.shard_size), force=args.force,
                    workers=args.workers)  # fmt: skip
    print(f"exported {args.src} to {out} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _random_tokens(vocab: int, batch: int, length: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def print_report(report: dict) -> None:
    verdict = "PASS" if report["pass"] else "FAIL"
    print(
        f"{verdict} ({report['dtype']}): max|dlogit| {report['max_abs']:.3g}  mean|dlogit| {report['mean_abs']:.3g}  "
        f"KL mean {report['kl_mean']:.3g} max {report['kl_max']:.3g}  top-1 {report['top1']:.4f}  "
        f"top-5 {report['top5']:.4f}  ppl ref {report.get('ppl_ref', float('nan')):.4g} "
        f"jax {report.get('ppl_jax', float('nan')):.4g}"
    )
    print("  thresholds: " + ", ".join(f"{k} {v:g}" for k, v in report["thresholds"].items()))
    print("  max |dh| per layer: " + " ".join(f"{layer['max_abs']:.2g}" for layer in report["layers"]))


def _cmd_validate(args) -> int:
    import moe_jax
    from validation.parity import compare
    from validation.reference import load_reference

    t0 = time.perf_counter()
    model = moe_jax.from_pretrained(args.hf, dtype=args.dtype)
    ref = load_reference(args.hf, args.dtype)
    tokens = _random_tokens(model.config.vocab_size, args.batch, args.tokens, args.seed)
    report = compare(model, ref, tokens, args.dtype)
    report["seconds"] = time.perf_counter() - t0
    print_report(report)
    if args.report:
        from converters.safetensors_io import write_text_atomic

        write_text_atomic(args.report, json.dumps(report, indent=2))
    return 0 if report["pass"] else EXIT_FAIL


def _cmd_quickstart(args) -> int:
    work = Path(args.workdir)
    tiny = work / "tiny-hf"
    print(f"[1/2] building the tiny DeepSeek-V3 checkpoint (FP8, sharded, with MTP) in {tiny}")
    from converters.tiny import make_tiny

    make_tiny(tiny, "wide", fp8_weights=True, shards=2)
    status = 0
    for dtype in ("float32", "bfloat16"):
        print(f"[2/2] JAX vs PyTorch (transformers) logits, {dtype}")
        ns = argparse.Namespace(hf=str(tiny), dtype=dtype, batch=4, tokens=64, seed=0, report=None)
        status = max(status, _cmd_validate(ns))
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser("quickstart", help="build the tiny checkpoint, load it in JAX, check parity with PyTorch")
    q.add_argument("--workdir", default="runs/quickstart")
    q.set_defaults(fn=_cmd_quickstart)

    t = sub.add_parser("make-tiny", help="write a tiny random DeepSeek-V3 checkpoint in the HF/DeepSeek format")
    t.add_argument("out")
    t.add_argument("--variant", default="base", help="base | flat | wide")
    t.add_argument("--fp8", action="store_true", help="store projections as DeepSeek FP8 (e4m3 + 128x128 scales)")
    t.add_argument("--dtype", choices=["float32", "bfloat16"], help="storage of non-FP8 tensors")
    t.add_argument("--shards", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=_cmd_make_tiny)

    c = sub.add_parser("convert", help="HF safetensors checkpoint (FP8/BF16/FP32) -> moe-jax JAX checkpoint")
    c.add_argument("--from", dest="fmt", choices=["hf"], required=True, help="source format")
    c.add_argument("src", help="HF checkpoint directory or hub repo id (the local cache works offline)")
    c.add_argument("--to", required=True, help="output directory")
    c.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    c.add_argument("--no-mtp", action="store_true", help="leave the MTP layers out")
    c.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    c.add_argument("--workers", type=int, default=4, help="reader/writer threads")
    c.set_defaults(fn=_cmd_convert)

    e = sub.add_parser("export", help="moe-jax JAX checkpoint -> HF safetensors shards")
    e.add_argument("--from", dest="src", required=True, help="moe-jax checkpoint directory")
    e.add_argument("--to", required=True, help="output directory")
    e.add_argument("--dtype", default="source", choices=["source", "bfloat16", "float32", "fp8"],
                   help="source: every tensor as it came in (FP8 stays FP8); fp8: DeepSeek's FP8 layout")
    e.add_argument("--shard-size", default="5GB")
    e.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    e.add_argument("--workers", type=int, default=4)
    e.set_defaults(fn=_cmd_export)

    v = sub.add_parser("validate", help="compare JAX logits with transformers' DeepseekV3ForCausalLM")
    v.add_argument("--hf", required=True, help="HF checkpoint directory")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    v.add_argument("--tokens", type=int, default=64, help="sequence length of the random prompts")
    v.add_argument("--batch", type=int, default=2)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--report", help="write the JSON report here")
    v.set_defaults(fn=_cmd_validate)
    return p


def main(argv: list[str] | None = None) -> int:
    from converters.safetensors_io import CheckpointError
    from moe_jax.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"moe-jax {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
