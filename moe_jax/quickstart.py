"""`moe-jax quickstart`: the whole round trip on the built-in tiny model, for a first look."""

from __future__ import annotations

import shutil
from pathlib import Path

import moe_jax
from converters.convert import convert_hf
from converters.export import export_hf
from converters.tiny import make_tiny
from moe_jax.errors import ConfigError
from moe_jax.train.config import load_config
from moe_jax.train.loop import train
from moe_jax.train.metrics.plots import plot, summary
from validation.layerwise import random_tokens
from validation.parity import compare, format_report
from validation.reference import load_reference


def quickstart(workdir: str | Path, steps: int = 40) -> bool:
    """HF checkpoint -> JAX (parity) -> convert -> validate (as training's gate) -> train on English
    text -> export -> reload in transformers, in `workdir`. True if every check passed."""
    work = Path(workdir)
    hf, converted, run, exported = work / "tiny-hf", work / "tiny-jax", work / "train", work / "trained-hf"
    # the training run is started over: only a previous quickstart's (its config.yaml), or nothing of anyone's
    if (
        run.is_symlink()
        or run.exists()
        and (not run.is_dir() or any(run.iterdir()) and not (run / "config.yaml").is_file())
    ):
        raise ConfigError(f"{run}: exists and is not a previous quickstart's run; refusing to remove it")
    print(f"[1/6] building a tiny DeepSeek-V3 checkpoint in DeepSeek's format (FP8, 2 shards, MTP) in {hf}")
    make_tiny(hf, "wide", fp8_weights=True, shards=2, force=True)
    passed = True
    tokens = random_tokens(moe_jax.from_pretrained(hf).config.vocab_size, 4, 64, 0)
    for dtype in ("float32", "bfloat16"):
        print(f"[2/6] JAX vs PyTorch (transformers) logits, {dtype}")
        report = compare(moe_jax.from_pretrained(hf, dtype=dtype), load_reference(hf, dtype), tokens, dtype)
        print(format_report(report))
        passed = passed and report["pass"]
    print(f"[3/6] converting to a JAX checkpoint (float32: training keeps float32 master weights): {converted}")
    convert_hf(hf, converted, dtype="float32", force=True, progress=False)
    print(
        f"[4/6] training {steps} steps on Python's own documentation text, after validating {converted} "
        f"against {hf} layer by layer (validate.required)"
    )
    cfg = load_config(
        None,
        [
            f"run_dir={run}",
            f"steps={steps}",
            f"model.init={converted}",
            "validate.required=true",
            "model.compute_dtype=float32",
            "checkpoint.every=20",
            "optim.warmup_steps=5",
        ],
    )
    if run.exists():
        shutil.rmtree(run)
    result = train(cfg, progress=True)
    print("      " + summary(run) + f"; curves: {plot(run)}")
    print(f"[5/6] exporting the trained model to HF safetensors in DeepSeek's FP8 format: {exported}")
    export_hf(result["model"], exported, dtype="fp8", force=True, progress=False)
    print("[6/6] the export in transformers' DeepseekV3ForCausalLM vs JAX reading the same files, float32")
    report = compare(moe_jax.from_pretrained(exported), load_reference(exported), tokens)
    print(format_report(report))
    requant = compare(moe_jax.from_pretrained(result["model"]), load_reference(exported), tokens)
    print(
        f"      trained float32 weights vs their FP8 export: KL mean {requant['kl_mean']:.3g}, "
        f"top-1 {requant['top1']:.4f} (the effect of re-quantizing to FP8)"
    )
    return passed and report["pass"]
