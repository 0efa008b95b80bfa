"""`moe-jax validate`: the JAX model against transformers' DeepseekV3ForCausalLM, one decoder
layer at a time, so that a model far larger than host memory can be checked on one machine.

For each layer both sides are built from the checkpoints (the reference from the HF one, FP8
block-dequantized as DeepSeek does; the JAX side from `--jax DST` or from the same HF directory),
run, compared and freed before the next. Both layers are fed the reference's hidden state by
default (`feed="reference"`: every layer is judged on its own, and the first failing layer is
the culprit); `feed="own"` runs each side on its own output, as the whole models would.
"""

from __future__ import annotations

import functools
import gc
import resource
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from converters.hub import resolve_source
from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint
from converters.load import check_names, check_plan_size, read_checked
from converters.safetensors_io import CheckpointError, CheckpointReader
from converters.torch_interop import torch_slot, transformers_modeling
from moe_jax import dsa
from moe_jax.config import ModelConfig
from moe_jax.files import atomic_write
from moe_jax.kernels.attention import document_ids
from moe_jax.model import Context, attention_index, decoder_layer, head, rms_norm, rope_tables
from moe_jax.params import TIED_NAMES, entries, get_path, layer_prefix, layer_stack, leaf_dtype, np_dtype, set_path
from validation.parity import THRESHOLDS, logit_metrics, passes
from validation.reference import TORCH_DTYPES, hf_config, load_reference_tensor, quiet_transformers

# Per-layer tolerance on the relative RMS error of the layer output (the logits: parity.THRESHOLDS).
# Per-layer limits: the relative RMS error of the layer output over the tokens whose experts agree,
# and the share of tokens whose top-k expert set differs. In bfloat16 a token whose router scores
# nearly tie may pick another expert on either side and move far (as the logits' mean-KL rule
# allows); float32 allows neither.
# DeepSeek-V3.2's sparse attention likewise: a query whose index scores nearly tie may keep another
# key on either side (index_mismatch: the share of queries whose chosen keys differ).
LAYER_LIMITS = {
    "float32": {"layer_rel_rms": 1e-5, "routing_mismatch": 0.0, "index_mismatch": 0.0},
    "bfloat16": {"layer_rel_rms": 5e-2, "routing_mismatch": 0.1, "index_mismatch": 0.1},
}


class JaxWeights:
    """Per-layer parameters of the JAX side, from a converted checkpoint or an HF directory."""

    def __init__(self, source: Path | Checkpoint, dtype: str | None = None):
        """`source`: an HF directory, a converted checkpoint's directory, or the opened checkpoint;
        `dtype`: of the parameters (default: `default_dtype`)."""
        if isinstance(source, Checkpoint):
            self.converted = source
        else:
            self.converted = Checkpoint(source) if is_jax_checkpoint(source) else None
        self.path = path = self.converted.path if self.converted else Path(source)
        self.cfg = self.converted.cfg if self.converted else ModelConfig.from_json(path)
        self.plan = entries(self.cfg, mtp=False)
        if not self.converted:  # (a converted checkpoint's manifest was checked against its config)
            self.reader = CheckpointReader(path, self.cfg.tensor_prefix)
            check_plan_size(self.reader, self.cfg, False)
            check_names(self.reader, self.cfg, self.plan, False)
        self.dtype, self.dtype_reason = (dtype, "as asked") if dtype else self.default_dtype()

    def default_dtype(self) -> tuple[str, str]:
        """(dtype, why): what a converted checkpoint holds; for an HF checkpoint, what `convert`
        would give it (float32 if it stores weights in float32, else bfloat16)."""
        if self.converted:
            return self.converted.dtype, f"the dtype {self.path} holds"
        stored = {self.reader.dtypes[e.hf_name] for e in self.plan if not e.rule.float32}
        dtype = "float32" if "F32" in stored else "bfloat16"
        return dtype, f"{self.path} stores {'/'.join(sorted(stored))} weights"

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

    def embed_rows(self, tokens: np.ndarray) -> np.ndarray:
        """The embedding rows of `tokens` [B, S], without reading the rest of the embedding."""
        ids, inverse = np.unique(tokens, return_inverse=True)
        if self.converted:
            rows = np.stack([self.converted.read(("params", "embed"), int(i)) for i in ids])
        else:
            rows = _rows(self.reader, TIED_NAMES["embed"], ids)
        return rows[inverse.reshape(tokens.shape)]


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
def reference_layer(reader: CheckpointReader, cfg: ModelConfig, config, layer: int, dtype: str) -> torch.nn.Module:
    """transformers' DeepseekV3DecoderLayer (DeepseekV32DecoderLayer) `layer`, weights from the
    checkpoint, no random init."""
    modeling, prefix = transformers_modeling(cfg)

    with torch.device("meta"):
        module = getattr(modeling, prefix + "DecoderLayer")(config, layer).to(TORCH_DTYPES[dtype])
        if hasattr(module.mlp, "gate"):
            module.mlp.gate.to(torch.float32)  # transformers keeps the router in float32
    module = module.to_empty(device="cpu").eval()
    prefix = layer_prefix(layer)
    state = {prefix + k: v for k, v in module.state_dict().items()}
    for name in reader.names():
        if name.startswith(prefix) and not name.endswith("_scale_inv"):
            slot = torch_slot(state, name)
            if slot is None:
                raise CheckpointError(f"{reader.file_of(name)}: tensor {name} has no place in layer {layer}")
            slot.copy_(torch.from_numpy(load_reference_tensor(reader, name)))
    return module


def routed_alike(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per token [T]: whether the two top-k expert sets [T, k] are the same."""
    return (np.sort(a.reshape(len(a), -1), axis=-1) == np.sort(b.reshape(len(b), -1), axis=-1)).all(-1)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Reference:
    """The PyTorch side: transformers' decoder layers built one at a time from the HF checkpoint."""

    def __init__(self, hf: Path, dtype: str):
        self.cfg = ModelConfig.from_json(hf)
        self.reader = CheckpointReader(hf, self.cfg.tensor_prefix)
        self.hf_config = hf_config(hf)
        check_plan_size(self.reader, self.cfg, False)
        check_names(self.reader, self.cfg, entries(self.cfg, mtp=False), False)
        self.dtype, self.torch_dtype = dtype, TORCH_DTYPES[dtype]

    def embed(self, tokens: np.ndarray) -> torch.Tensor:
        ids, inverse = np.unique(tokens, return_inverse=True)
        rows = _rows(self.reader, TIED_NAMES["embed"], ids).astype(np.float32)[inverse.reshape(tokens.shape)]
        return torch.from_numpy(rows).to(self.torch_dtype)

    def context(self, h: torch.Tensor, positions: np.ndarray) -> dict:
        """Keyword arguments every decoder layer takes: causal mask (one a row: DeepSeek-V3.2's
        sparse attention masks each row's own keys), positions, rotary tables."""
        modeling, prefix = transformers_modeling(self.cfg)
        b, s = positions.shape
        pos = torch.as_tensor(positions, dtype=torch.long)
        mask = torch.full((s, s), torch.finfo(self.torch_dtype).min, dtype=self.torch_dtype).triu(1)
        rotary = getattr(modeling, prefix + "RotaryEmbedding")(self.hf_config)
        return dict(attention_mask=mask.expand(b, 1, s, s), position_ids=pos, position_embeddings=rotary(h, pos))

    @torch.no_grad()
    def run_layer(self, layer: int, h: torch.Tensor, context: dict) -> tuple[torch.Tensor, dict]:
        """The layer's output and what it chose: `experts` (the router's, a MoE layer) and `keys`
        (the indexer's, DeepSeek-V3.2); the layer's weights are freed before returning."""
        module = reference_layer(self.reader, self.cfg, self.hf_config, layer, self.dtype)
        captured = {}
        if hasattr(module.mlp, "gate"):  # output: (router_logits, topk_weights, topk_indices)
            module.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.update(experts=out[2].numpy()))
        if hasattr(module.self_attn, "indexer"):  # DeepSeek-V3.2: each query's chosen keys [B, S, k]
            module.self_attn.indexer.register_forward_hook(lambda _m, _i, out: captured.update(keys=out.numpy()))
        out = module(h, **context)
        alive = weakref.ref(module)
        del module  # freed here by reference counting; a full collection (0.4 s) only if a cycle holds it
        if alive() is not None:
            gc.collect()
        return (out[0] if isinstance(out, tuple) else out), captured

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> np.ndarray:
        tensor = lambda name: torch.from_numpy(np.asarray(load_reference_tensor(self.reader, name), np.float32))  # noqa: E731
        x = h.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(self.torch_dtype)
        x = x * tensor(TIED_NAMES["final_norm"]).to(self.torch_dtype)
        return (x @ tensor(TIED_NAMES["lm_head"]).to(self.torch_dtype).T).float().numpy()


def thresholds(dtype: str) -> dict:
    """The pass limits in `dtype`: the layer-output tolerance plus the logit limits of `parity`."""
    return {**LAYER_LIMITS[dtype], **THRESHOLDS[dtype]}


def rel_rms(diff: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt((diff**2).mean() / max((ref**2).mean(), 1e-30))) if diff.size else 0.0


def keys_alike(keys: np.ndarray, valid: np.ndarray, ref_keys: np.ndarray) -> np.ndarray:
    """Per query [B * S]: whether both sides chose the same keys among those it may see (one
    document a row: the keys at or before it). keys, valid [B, S, k]: ours; ref_keys [B, S, k']:
    transformers' (whose surplus choices past a query's own keys are masked)."""
    b, s, _ = ref_keys.shape
    ours = np.zeros((b, s, s + 1), bool)
    np.put_along_axis(ours, np.where(valid, keys, s), True, axis=-1)
    ref = np.zeros((b, s, s + 1), bool)
    np.put_along_axis(ref, ref_keys.astype(np.int64), True, axis=-1)
    ref[:, :, :s] &= np.tril(np.ones((s, s), bool))
    return (ours[..., :s] == ref[..., :s]).all(-1).reshape(-1)


def compare_layer(
    layer: int, kind: str, ref_out: np.ndarray, got_out: np.ndarray, ref_chosen: dict, got_routing, got_keys, limits
) -> dict:
    """One row of the report: the error of a layer's output [B, S, H] (over all tokens, and over
    those whose experts and attended keys agree, which is judged), and the shares of tokens whose
    experts (routing_mismatch) or, for DeepSeek-V3.2, chosen keys (index_mismatch) differ."""
    ref = ref_out.astype(np.float64).reshape(-1, ref_out.shape[-1])
    diff = got_out.astype(np.float64).reshape(ref.shape) - ref
    routed = keyed = np.ones(len(ref), bool)
    if got_routing is not None and ref_chosen.get("experts") is not None:
        routed = routed_alike(np.asarray(got_routing.experts), np.asarray(ref_chosen["experts"]))
    if got_keys is not None and ref_chosen.get("keys") is not None:
        keyed = keys_alike(*map(np.asarray, got_keys), ref_chosen["keys"])
    alike = routed & keyed
    row = {
        "layer": layer,
        "kind": kind,
        "max_abs": float(np.abs(diff).max()),
        "rel_rms": rel_rms(diff, ref),
        "rel_rms_routed_alike": rel_rms(diff[alike], ref[alike]),
        "routing_mismatch": None if got_routing is None else float(1 - routed.mean()),
        "index_mismatch": None if got_keys is None else float(1 - keyed.mean()),
    }
    row["pass"] = (
        row["rel_rms_routed_alike"] <= limits["layer_rel_rms"]
        and (row["routing_mismatch"] or 0.0) <= limits["routing_mismatch"]
        and (row["index_mismatch"] or 0.0) <= limits["index_mismatch"]
    )
    return row


def describe_row(row: dict) -> str:
    differ = [
        f"{what} differ for {share:.1%} of tokens"
        for what, share in (("experts", row["routing_mismatch"]), ("attended keys", row.get("index_mismatch")))
        if share
    ]
    return (
        f"  layer {row['layer']:3d} {row['kind']:5s} rel err {row['rel_rms']:.2e}  max |dh| {row['max_abs']:.2e}"
        + (f"  {', '.join(differ)} (rel err of the others {row['rel_rms_routed_alike']:.2e})" if differ else "")
        + ("" if row["pass"] else "  <-- FAIL")
    )


def validate(
    hf: str | Path,
    tokens: np.ndarray,
    jax_path: str | Path | Checkpoint | None = None,
    dtype: str | None = None,
    feed: str = "reference",
    progress=print,
) -> dict:
    """Compare the model in `jax_path` (a converted checkpoint, opened or not; default: `hf` itself
    read by the JAX loader) with transformers on `hf`, layer by layer; returns the report (see
    README for its fields). `dtype`: of both sides (default: the JAX side's `default_dtype`), with
    that dtype's tolerances."""
    quiet_transformers()
    t0 = time.perf_counter()
    hf = resolve_source(hf)
    ours = JaxWeights(jax_path if jax_path is not None else hf, dtype)
    dtype, cfg = ours.dtype, ours.cfg
    mode = (
        "layerwise: both sides fed the reference's hidden state"
        if feed == "reference"
        else "each side on its own output"
    )
    progress(
        f"validating {ours.path} against transformers on {hf}: {tokens.shape[0]} x {tokens.shape[1]} tokens, "
        f"{dtype} ({ours.dtype_reason}), {mode}"
    )
    ref = Reference(hf, dtype)
    if [e.param_shape for e in entries(cfg, False)] != [e.param_shape for e in entries(ref.cfg, False)]:
        raise CheckpointError(f"{ours.path}: parameter shapes differ from {hf}: not the same architecture")
    limits = thresholds(dtype)
    if feed != "reference":
        # each side on its own output: where the hidden states have drifted apart (by the rounding
        # of the layers before), a query's index scores move and its k-of-S choice with them; the
        # choices are judged where both sides get the same input (feed "reference"), and here
        # only reported (the logits judge the whole)
        limits = {**limits, "index_mismatch": 1.0}
    to_jax = lambda h: jnp.asarray(h.float().numpy()).astype(np_dtype(dtype))  # noqa: E731

    # both sides start from the same embedding rows, at positions 0..S-1 of one segment
    positions = np.tile(np.arange(tokens.shape[1], dtype=np.int32), (tokens.shape[0], 1))
    h_ref = ref.embed(tokens)
    h_jax = jnp.asarray(ours.embed_rows(tokens)).astype(np_dtype(dtype))
    ref_context = ref.context(h_ref, positions)
    ctx = Context(*rope_tables(cfg, jnp.asarray(positions)), jnp.zeros(tokens.shape, jnp.int32))
    run_layer = jax.jit(decoder_layer, static_argnames=("cfg", "backend"))

    layers = []
    for layer in range(cfg.num_hidden_layers):
        # the reference layer runs and is freed before the JAX layer is loaded: peak memory is
        # one layer's weights (plus one parameter's host copy), whatever the depth
        h_ref_next, ref_chosen = ref.run_layer(layer, h_ref, ref_context)
        params = ours.layer(layer)
        x_in = to_jax(h_ref) if feed == "reference" else h_jax
        h_jax, routing, _ = run_layer(params["params"], params.get("buffers", {}), x_in, ctx, cfg, None)
        keys = chosen_keys(params["params"], x_in, ctx, cfg) if "keys" in ref_chosen else None
        del params  # JAX arrays: freed by reference counting
        row = compare_layer(
            layer,
            layer_stack(cfg, layer)[0],
            h_ref_next.float().numpy(),
            np.asarray(h_jax, np.float32),
            ref_chosen,
            routing,
            keys,
            limits,
        )
        layers.append(row)
        progress(describe_row(row))
        h_ref = h_ref_next

    top = ours.top()
    h_final = to_jax(h_ref) if feed == "reference" else h_jax
    logits = logit_metrics(
        ref.logits(h_ref), np.asarray(head(top, top["final_norm"], h_final, cfg), np.float32), tokens
    )
    first = next((r["layer"] for r in layers if not r["pass"]), None)
    return {
        "pass": first is None and passes(logits, THRESHOLDS[dtype]),
        "first_failing_layer": first,
        "logits": logits,
        "layers": layers,
        "dtype": dtype,
        "dtype_reason": ours.dtype_reason,
        "feed": feed,
        "thresholds": limits,
        "tokens": list(tokens.shape),
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": time.perf_counter() - t0,
    }


@functools.partial(jax.jit, static_argnames="cfg")
def chosen_keys(p: dict, h: jax.Array, ctx: Context, cfg: ModelConfig):
    """DeepSeek-V3.2: the keys each query of decoder layer `p`'s attention chooses for input h
    (positions [B, S, k], valid [B, S, k])."""
    x = rms_norm(h, p["input_norm"], cfg.rms_norm_eps)
    index = attention_index(p["attn"], x, ctx.cos, ctx.sin, cfg)
    return dsa.select(index, document_ids(ctx.segment_ids), cfg.index_topk)


def random_tokens(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def prompt_tokens(tokenizer, prompts: Path, max_len: int) -> np.ndarray:
    """Lines of `prompts` through `tokenizer` (its `encode_batch`: the checkpoint's, as training
    loads it), cut to a common length."""
    try:
        text = prompts.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{prompts}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{prompts}: no prompts")
    ids = tokenizer.encode_batch(lines)
    n = min(max_len, *(len(i) for i in ids))
    return np.array([i[:n] for i in ids], np.int32)


def plot(report: dict, path: str | Path) -> None:
    layers = report["layers"]
    x = [r["layer"] for r in layers]
    fig = Figure(figsize=(max(6, len(x) * 0.25), 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.semilogy(x, [max(r["rel_rms"], 1e-12) for r in layers], "o-", label="relative error of layer output")
    ax.axhline(report["thresholds"]["layer_rel_rms"], color="r", ls="--", label="tolerance")
    ax2 = None
    for key, color, label in (
        ("routing_mismatch", "gray", "experts differ"),
        ("index_mismatch", "tab:orange", "keys differ"),
    ):
        mism = [(r["layer"], r[key]) for r in layers if r.get(key)]
        if mism:
            ax2 = ax2 or ax.twinx()
            ax2.bar([m[0] for m in mism], [m[1] for m in mism], alpha=0.3, color=color, label=label)
    if ax2 is not None:
        ax2.set_ylabel("tokens that chose otherwise")
        ax2.legend(loc="upper right", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("||h_jax - h_ref|| / ||h_ref||")
    verdict = "PASS" if report["pass"] else f"FAIL (first failing layer {report['first_failing_layer']})"
    ax.set_title(f"moe-jax validate, {report['dtype']}: {verdict}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
