"""Parity figures, JAX vs transformers, for the tiny fixtures in float32 and bfloat16.

Also measures each bf16 model against the float32 reference, so that our bf16 error can be
read beside PyTorch's own. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_parity.py --out runs/bench_parity.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

import moe_jax
from converters.tiny import make_tiny
from moe_jax.measure import benchmark_parser
from validation.parity import compare, logit_metrics
from validation.reference import load_reference

CASES = {
    "base (grouped, yarn, q_lora)": dict(variant="base"),
    "flat (no groups, q_proj, rope)": dict(variant="flat"),
    "wide fp8 (edge blocks)": dict(variant="wide", fp8_weights=True),
}


@torch.no_grad()
def main() -> None:
    ap = benchmark_parser(__doc__, "bench_parity")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in CASES.items():
            path = make_tiny(Path(tmp) / name.split()[0], **kw)
            tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.tokens)).astype(np.int32)
            ref32 = load_reference(path, "float32")
            truth = ref32(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
            for dtype in ("float32", "bfloat16"):
                model = moe_jax.from_pretrained(path, dtype=dtype)
                ref = ref32 if dtype == "float32" else load_reference(path, dtype)
                report = compare(model, ref, tokens, dtype)
                ref_logits = ref(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
                row = {
                    "case": name,
                    "dtype": dtype,
                    "pass": report["pass"],
                    **{k: report[k] for k in ("max_abs", "mean_abs", "kl_mean", "kl_max", "top1", "top5")},
                    "torch_vs_f32_kl_mean": logit_metrics(truth, ref_logits)["kl_mean"],
                    "jax_vs_f32_kl_mean": logit_metrics(truth, np.asarray(model(tokens)))["kl_mean"],
                }
                rows.append(row)
    head = "| case | dtype | max abs | mean abs | KL mean | KL max | top-1 | KL mean to f32: torch / jax |"
    print(head + "\n|" + "---|" * 8)
    for r in rows:
        print(
            f"| {r['case']} | {r['dtype']} | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | {r['kl_mean']:.2e} | "
            f"{r['kl_max']:.2e} | {r['top1']:.4f} | {r['torch_vs_f32_kl_mean']:.2e} / {r['jax_vs_f32_kl_mean']:.2e} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"batch": args.batch, "tokens": args.tokens, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
