"""`moe-jax validate`: the JAX model against transformers' DeepseekV3ForCausalLM, one decoder
layer at a time, so that a model far larger than host memory can be checked on one machine.

For each layer both sides are built from the checkpoints (the reference from the HF one, FP8
block-dequantized as DeepSeek does; the JAX side from `--jax DST` or from the same HF directory),
run, compared and freed before the next. Both layers are fed the reference's hidden state by
default (`feed="reference"`: every layer is judged on its own, and the first failing layer is
the culprit); `feed="own"` runs each side on its own output, as the whole models would.
"""

from __future__ import annotations

import gc
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from converters.files import atomic_write
from converters.hub import resolve_source
from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint
from converters.load import check_plan_size, read_checked
from moe_jax.params import entries, get_path, layer_stack, leaf_dtype, np_dtype, set_path
from converters.safetensors_io import CheckpointError, CheckpointReader
from moe_jax.config import ModelConfig
from moe_jax.model import Context, attention_mask, decoder_layer, head, rope_tables
from validation.parity import logit_metrics, passes
from validation.reference import TORCH_DTYPES, hf_config, load_reference_tensor, quiet_transformers

# Per-layer tolerance on the relative RMS error of the layer output, and logit thresholds.
THRESHOLDS = {
    "float32": {"layer_rel_rms": 1e-5, "max_abs": 1e-4, "kl_max": 1e-7, "top1": 1.0},
    "bfloat16": {"layer_rel_rms": 5e-2, "kl_mean": 1e-2, "top1": 0.9},
}


class JaxWeights:
    """Per-layer parameters of the JAX side, from a converted checkpoint or an HF directory."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = Path(path), dtype
        self.converted = Checkpoint(path) if is_jax_checkpoint(path) else None
        self.cfg = self.converted.cfg if self.converted else ModelConfig.from_json(path)
        if not self.converted:  # (a converted checkpoint's manifest was checked against its config)
            self.reader = CheckpointReader(path)
            check_plan_size(self.reader, self.cfg, False)
        self.plan = entries(self.cfg, mtp=False)

    def _tree(self, select) -> dict:
        tree: dict = {}
        for e in self.plan:
            if e.rule.tied_to or not select(e):
                continue
            dtype = leaf_dtype(e.rule, self.dtype)
            if self.converted:
                value = self.converted.read(e.path, e.index).astype(dtype)
            else:
                value = read_checked(self.reader, e, dtype)
            sub = e.path[2:] if e.stack else e.path[1:]
            if len(e.index) == 2:  # one expert of a stacked [E, ...] parameter
                try:
                    dest = get_path(tree, e.path[0:1] + sub)
                except KeyError:
                    dest = np.empty((e.stack[1], *value.shape), value.dtype)
                    set_path(tree, e.path[0:1] + sub, dest)
                dest[e.index[1]] = value
            else:
                set_path(tree, e.path[0:1] + sub, value)
        return _to_device_one_by_one(tree)

    def layer(self, layer: int) -> dict:
        kind, i = layer_stack(self.cfg, layer)
        return self._tree(lambda e: bool(e.stack) and e.path[1] == kind and e.index[0] == i)

    def top(self) -> dict:
        return self._tree(lambda e: not e.stack)["params"]

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of the embedding, without reading the rest of it."""
        if self.converted:
            return np.stack([self.converted.read(("params", "embed"), int(i)) for i in ids])
        return _rows(self.reader, "model.embed_tokens.weight", ids)


def _rows(reader: CheckpointReader, name: str, ids: np.ndarray) -> np.ndarray:
    return np.concatenate([reader.get_slice(name, slice(int(i), int(i) + 1)) for i in ids])


def _to_device_one_by_one(tree: dict) -> dict:
    """numpy leaves -> jax arrays, freeing each host copy as soon as it is on the device."""
    for key, value in tree.items():
        if isinstance(value, dict):
            _to_device_one_by_one(value)
        else:
            tree[key] = jnp.asarray(value)
            del value
    return tree


@torch.no_grad()
def reference_layer(reader: CheckpointReader, config, layer: int, dtype: str) -> torch.nn.Module:
    """transformers' DeepseekV3DecoderLayer `layer`, weights from the checkpoint, no random init."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    with torch.device("meta"):
        module = DeepseekV3DecoderLayer(config, layer).to(TORCH_DTYPES[dtype])
        if hasattr(module.mlp, "gate"):
            module.mlp.gate.to(torch.float32)  # transformers keeps the router in float32
    module = module.to_empty(device="cpu").eval()
    state = {f"model.layers.{layer}.{k}": v for k, v in module.state_dict().items()}
    prefix = f"model.layers.{layer}."
    from converters.torch_interop import torch_slot

    for name in reader.names():
        if name.startswith(prefix) and not name.endswith("_scale_inv"):
            slot = torch_slot(state, name)
            if slot is None:
                raise CheckpointError(f"{reader.file_of(name)}: tensor {name} has no place in layer {layer}")
            slot.copy_(torch.from_numpy(load_reference_tensor(reader, name)))
    return module


def _routing_mismatch(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of tokens whose top-k expert sets differ."""
    return float(np.mean([set(x) != set(y) for x, y in zip(a.tolist(), b.tolist())]))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@torch.no_grad()
def validate(
    hf: str | Path,
    tokens: np.ndarray,
    jax_path: str | Path | None = None,
    dtype: str = "float32",
    feed: str = "reference",
    progress=print,
) -> dict:
    """Compare layer by layer; returns the report (see README for its fields)."""
    quiet_transformers()
    t0 = time.perf_counter()
    hf = resolve_source(hf)
    reader = CheckpointReader(hf)
    ref_cfg = hf_config(hf)
    ours = JaxWeights(Path(jax_path) if jax_path else hf, dtype)
    cfg = ours.cfg
    ref_model_cfg = ModelConfig.from_json(hf)
    check_plan_size(reader, ref_model_cfg, False)
    if [e.param_shape for e in entries(cfg, False)] != [e.param_shape for e in entries(ref_model_cfg, False)]:
        raise CheckpointError(f"{jax_path}: parameter shapes differ from {hf}: not the same architecture")
    limits = THRESHOLDS[dtype]
    tdt = TORCH_DTYPES[dtype]
    b, s = tokens.shape

    ids, inverse = np.unique(tokens, return_inverse=True)
    emb = _rows(reader, "model.embed_tokens.weight", ids).astype(np.float32)[inverse.reshape(tokens.shape)]
    h_ref = torch.from_numpy(emb).to(tdt)
    h_jax = jnp.asarray(ours.embed_rows(ids)[inverse.reshape(tokens.shape)]).astype(np_dtype(dtype))
    positions = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    pos_t = torch.as_tensor(positions, dtype=torch.long)
    rope = DeepseekV3RotaryEmbedding(ref_cfg)(h_ref, pos_t)
    mask_t = torch.full((s, s), torch.finfo(tdt).min, dtype=tdt).triu(1)[None, None]
    cos, sin = rope_tables(cfg, jnp.asarray(positions))
    ctx = Context(cos, sin, attention_mask(jnp.zeros((b, s), jnp.int32)))
    run_layer = jax.jit(decoder_layer, static_argnames=("cfg", "backend"))

    layers = []
    for layer in range(cfg.num_hidden_layers):
        # the reference layer runs and is freed before the JAX layer is loaded: peak memory is
        # one layer's weights (plus one parameter's host copy), whatever the depth
        module = reference_layer(reader, ref_cfg, layer, dtype)
        captured = {}

        def keep_experts(_module, _inputs, output):  # (router_logits, topk_weights, topk_indices)
            captured["experts"] = output[2]

        if hasattr(module.mlp, "gate"):
            module.mlp.gate.register_forward_hook(keep_experts)
        out = module(h_ref, attention_mask=mask_t, position_ids=pos_t, position_embeddings=rope)
        h_ref_next = out[0] if isinstance(out, tuple) else out
        del module, out
        gc.collect()

        params = ours.layer(layer)
        x_in = jnp.asarray(h_ref.float().numpy()).astype(np_dtype(dtype)) if feed == "reference" else h_jax
        h_jax, routing = run_layer(params["params"], params.get("buffers", {}), x_in, ctx, cfg, None)
        h_jax.block_until_ready()
        del params
        gc.collect()

        ref_np, got_np = h_ref_next.float().numpy(), np.asarray(h_jax, np.float32)
        diff = got_np.astype(np.float64) - ref_np
        row = {
            "layer": layer,
            "kind": layer_stack(cfg, layer)[0],
            "max_abs": float(np.abs(diff).max()),
            "rel_rms": float(np.sqrt((diff**2).mean() / max((ref_np.astype(np.float64) ** 2).mean(), 1e-30))),
            "routing_mismatch": None,
        }
        if routing is not None and "experts" in captured:
            row["routing_mismatch"] = _routing_mismatch(np.asarray(routing.experts), captured["experts"].numpy())
        row["pass"] = row["rel_rms"] <= limits["layer_rel_rms"]
        layers.append(row)
        progress(
            f"  layer {layer:3d} {row['kind']:5s} rel err {row['rel_rms']:.2e}  max |dh| {row['max_abs']:.2e}"
            + (f"  routing differs for {row['routing_mismatch']:.1%} of tokens" if row["routing_mismatch"] is not None else "")
            + ("" if row["pass"] else "  <-- FAIL")
        )
        h_ref = h_ref_next

    top = ours.top()
    final_norm = torch.from_numpy(np.asarray(load_reference_tensor(reader, "model.norm.weight"), np.float32)).to(tdt)
    lm_head = torch.from_numpy(np.asarray(load_reference_tensor(reader, "lm_head.weight"), np.float32)).to(tdt)
    x = h_ref.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref_model_cfg.rms_norm_eps)).to(tdt) * final_norm
    ref_logits = (x @ lm_head.T).float().numpy()
    h_final = jnp.asarray(h_ref.float().numpy()).astype(np_dtype(dtype)) if feed == "reference" else h_jax
    jax_logits = np.asarray(head(top, top["final_norm"], h_final, cfg), np.float32)
    logits = logit_metrics(ref_logits, jax_logits, tokens)
    logit_limits = {k: v for k, v in limits.items() if k != "layer_rel_rms"}

    first = next((r["layer"] for r in layers if not r["pass"]), None)
    return {
        "pass": first is None and passes(logits, logit_limits),
        "first_failing_layer": first,
        "logits": logits,
        "layers": layers,
        "dtype": dtype,
        "feed": feed,
        "thresholds": limits,
        "tokens": list(tokens.shape),
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": time.perf_counter() - t0,
    }


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    x = [r["layer"] for r in layers]
    fig, ax = plt.subplots(figsize=(max(6, len(x) * 0.25), 3.5))
    ax.semilogy(x, [max(r["rel_rms"], 1e-12) for r in layers], "o-", label="relative error of layer output")
    ax.axhline(report["thresholds"]["layer_rel_rms"], color="r", ls="--", label="tolerance")
    mism = [(r["layer"], r["routing_mismatch"]) for r in layers if r["routing_mismatch"]]
    if mism:
        ax2 = ax.twinx()
        ax2.bar([m[0] for m in mism], [m[1] for m in mism], alpha=0.3, color="gray", label="routing differs")
        ax2.set_ylabel("tokens with another expert set")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("||h_jax - h_ref|| / ||h_ref||")
    verdict = "PASS" if report["pass"] else f"FAIL (first failing layer {report['first_failing_layer']})"
    ax.set_title(f"moe-jax validate, {report['dtype']}: {verdict}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
