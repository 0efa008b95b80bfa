"""Logit and hidden-state parity between our JAX model and the PyTorch reference."""

from __future__ import annotations

import numpy as np
import torch

from moe_jax.model import rms_norm

# Pass thresholds per compute dtype (both sides in that dtype). In bfloat16 a few tokens flip
# an expert choice and move far, on either side alike, so bf16 is judged on the mean KL.
THRESHOLDS = {
    "float32": {"max_abs": 1e-4, "kl_max": 1e-7, "top1": 1.0},
    "bfloat16": {"kl_mean": 1e-2, "top1": 0.9},
}


def passes(report: dict, limits: dict) -> bool:
    return all(report[k] >= v if k.startswith("top") else report[k] <= v for k, v in limits.items())


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logit_metrics(ref: np.ndarray, got: np.ndarray, tokens: np.ndarray | None = None) -> dict:
    """ref, got: [B, S, V]. KL(ref || got) per token, agreement, and (with tokens) perplexities."""
    lp_ref, lp_got = log_softmax64(ref), log_softmax64(got)
    kl = (np.exp(lp_ref) * (lp_ref - lp_got)).sum(-1)  # [B, S]
    top5_ref = np.argsort(-ref, axis=-1)[..., :5]
    top5_got = np.argsort(-got, axis=-1)[..., :5]
    top5 = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top5_ref.reshape(-1, 5), top5_got.reshape(-1, 5))])
    out = {
        "max_abs": float(np.abs(ref.astype(np.float64) - got).max()),
        "mean_abs": float(np.abs(ref.astype(np.float64) - got).mean()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()),
        "top5": float(top5),
    }
    if tokens is not None and tokens.shape[1] > 1:
        nxt = tokens[:, 1:, None]
        out["ppl_ref"] = float(np.exp(-np.take_along_axis(lp_ref[:, :-1], nxt, -1).mean()))
        out["ppl_jax"] = float(np.exp(-np.take_along_axis(lp_got[:, :-1], nxt, -1).mean()))
    return out


@torch.no_grad()
def compare(jax_model, torch_model, tokens: np.ndarray, dtype: str = "float32") -> dict:
    """Run both models on `tokens` [B, S]; logit metrics plus max error after every layer."""
    ref = torch_model(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    out = jax_model.apply(tokens)
    ref_hidden = [h.float().numpy() for h in ref.hidden_states]
    got_hidden = [np.asarray(h, np.float32) for h in out.hidden_states]
    # transformers reports the last layer's output after the final norm
    cfg = jax_model.config
    got_hidden[-1] = np.asarray(
        rms_norm(out.hidden_states[-1], jax_model.params["final_norm"], cfg.rms_norm_eps), np.float32
    )
    layers = [
        {"layer": i, "max_abs": float(np.abs(r - g).max()), "ref_rms": float(np.sqrt((r**2).mean()))}
        for i, (r, g) in enumerate(zip(ref_hidden, got_hidden))
    ]
    report = logit_metrics(ref.logits.float().numpy(), np.asarray(out.logits, np.float32), tokens)
    limits = THRESHOLDS[dtype]
    report["layers"] = layers
    report["dtype"] = dtype
    report["thresholds"] = limits
    report["pass"] = passes(report, limits)
    return report


def format_report(report: dict) -> str:
    """A validation report (this module's or `layerwise`'s) as the lines the CLI prints."""
    verdict = "PASS" if report["pass"] else "FAIL"
    lg = report.get("logits", report)
    lines = [
        f"{verdict} ({report['dtype']}): max|dlogit| {lg['max_abs']:.3g}  mean|dlogit| {lg['mean_abs']:.3g}  "
        f"KL mean {lg['kl_mean']:.3g} max {lg['kl_max']:.3g}  top-1 {lg['top1']:.4f}  "
        f"top-5 {lg['top5']:.4f}  ppl ref {lg.get('ppl_ref', float('nan')):.4g} jax {lg.get('ppl_jax', float('nan')):.4g}",
        "  thresholds: " + ", ".join(f"{k} {v:g}" for k, v in report["thresholds"].items()),
    ]
    if report.get("first_failing_layer") is not None:
        lines.append(f"  first layer over tolerance: {report['first_failing_layer']}")
    if "peak_rss_bytes" in report:
        lines.append(f"  peak memory {report['peak_rss_bytes'] / 2**30:.2f} GiB, {report['seconds']:.1f} s")
    return "\n".join(lines)
