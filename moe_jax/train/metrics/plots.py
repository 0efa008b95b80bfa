"""Plots of a run's metrics (moe_jax.train.metrics.store): `figure(run_dir)`, `plot(run_dir)` -> RUN/metrics.png,
and `summary(run_dir)` -> one line for the CLI."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from moe_jax.files import atomic_write
from moe_jax.train.metrics.store import (
    ExpertLoads,
    loads_path,
    metrics_path,
    read_expert_loads,
    read_loads_header,
    read_metrics,
)

PLOT_FILE = "metrics.png"
HEATMAP_LAYERS = 8  # heat maps drawn at most: every layer when there are no more, else the most imbalanced
MAP_COLUMNS = 1200  # steps drawn at most across a map; more are grouped (max for the per-layer maps, mean per expert)
_SHARE_NORM = PowerNorm(0.5, 0.0, 1.0)  # square-root colour scale: 1/E-sized shares stay visible next to 1.0
_SHARE_CMAP = "magma"


def _by_step(records: list[dict]) -> list[dict]:
    """One record per step (the last one written wins), in step order."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def _layers(records: list[dict], key: str = "load_imbalance") -> np.ndarray | None:
    """(records, layers) float64, NaN-padded when the layer count varies; None if no record has a list there."""
    rows = [r.get(key) if isinstance(r.get(key), list) else [] for r in records]
    width = max(map(len, rows), default=0)
    if width == 0:
        return None
    out = np.full((len(records), width), np.nan)
    for i, row in enumerate(rows):
        for j, x in enumerate(row):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                out[i, j] = x
    return out


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.45", fontsize=10)


def _panel(
    ax, records, steps, keys: list[tuple[str, str]], title: str, *, ylabel: str = "", logy: bool = False
) -> bool:
    """Lines for the (key, label) pairs that were logged; a note when none was. True if anything was drawn."""
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    drawn, flagged, finite_all = False, False, []
    for key, label in keys:
        raw = _nonfinite_aware(records, key)
        if raw is None:
            continue
        values, bad = raw
        (ln,) = ax.plot(
            steps, values, marker="." if len(steps) < 50 else None, markersize=3, linewidth=1.2, label=label
        )
        if bad.any():
            flagged = True
            ax.plot(
                steps[bad],
                np.full(int(bad.sum()), 0.97),
                "x",
                color=ln.get_color(),
                markersize=5,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
            )
        finite_all.append(values[np.isfinite(values)])
        drawn = True
    if not drawn:
        _note(ax, f"no {' / '.join(k for k, _ in keys)} logged")
        return False
    if flagged:
        ax.set_title(f"{title}  (x: NaN/Inf)", fontsize=10, loc="left")
    vals = np.concatenate(finite_all)
    if logy and vals.size and (vals > 0).all():
        ax.set_yscale("log")
    if len(keys) > 1:
        ax.legend(fontsize=8)
    return True


def _nonfinite_aware(records, key) -> tuple[np.ndarray, np.ndarray] | None:
    """(values with NaN where missing or non-finite, mask of steps logged as NaN/Inf); None if never logged."""
    if not any(key in r for r in records):
        return None
    values = np.full(len(records), np.nan)
    bad = np.zeros(len(records), bool)
    for i, r in enumerate(records):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isfinite(v):
                values[i] = v
            else:
                bad[i] = True
    return values, bad


def _maybe_loads(path: Path) -> ExpertLoads | None:
    """read_expert_loads, or None when there is no file (or no record); duplicates of a step: the last wins."""
    if not loads_path(path).exists():
        return None
    loads = read_expert_loads(path)
    if not loads.steps.size:
        return None
    _, last = np.unique(loads.steps[::-1], return_index=True)  # sorted steps; index of each one's last record
    keep = len(loads.steps) - 1 - last
    return loads._replace(steps=loads.steps[keep], load=loads.load[keep], bias=loads.bias[keep])


def figure(run_dir) -> Figure:
    """The figure `plot` saves. Its first 3 x 2 panels: loss, balance loss, grad norm/lr, tokens/s, per-layer load
    imbalance and MFU vs step. When RUN/expert_loads.bin holds records, a second section follows: two layers x steps
    maps (the busiest expert's share of tokens and the router bias spread, every logged step) and heat maps of each
    expert's share of the layer's tokens over the stored steps (experts on y), for every layer when there are at most
    HEATMAP_LAYERS, else for the HEATMAP_LAYERS with the highest mean busiest-expert share, worst first.

    ValueError (naming the file) when there is no metrics.jsonl or it holds no records.
    """
    path = metrics_path(run_dir)
    records = _by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path}: no metrics records to plot")
    steps = np.array([r["step"] for r in records], dtype=np.int64)
    loads = _maybe_loads(path)
    if loads is None:
        fig = Figure(figsize=(14, 11), layout="constrained")
        top = fig
    else:
        chosen = _heat_layers(loads)
        heat_rows = math.ceil(len(chosen) / 4)
        fig = Figure(figsize=(14, 11 + 3.6 + 3.2 * heat_rows), layout="constrained")
        top, over, heats = fig.subfigures(3, 1, height_ratios=[11, 3.6, 3.2 * heat_rows])
    FigureCanvasAgg(fig)
    fig.suptitle(summary(path), fontsize=11)
    _scalar_panels(top, records, steps, loads.layer_names if loads is not None else [])
    if loads is not None:
        _overview(over, records, steps, loads)
        _heatmaps(heats, loads, chosen)
    return fig


def plot(run_dir, out=None) -> Path:
    """Draw `figure(run_dir)` to a PNG: by default RUN/metrics.png, written atomically. Panels whose metrics were
    never logged carry a note. ValueError (naming the file) when there is no metrics.jsonl or it holds no records.
    """
    fig = figure(run_dir)
    out = Path(out) if out is not None else metrics_path(run_dir).parent / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=90))
    return out


def _scalar_panels(fig, records: list[dict], steps: np.ndarray, names: Sequence[str]) -> None:
    axes = fig.subplots(3, 2)

    _panel(
        axes[0, 0],
        records,
        steps,
        [("loss", "total"), ("ce_loss", "CE"), ("mtp_loss", "MTP"), ("index_loss", "indexer KL")],
        "loss",
    )
    _panel(axes[0, 1], records, steps, [("balance_loss", "balance loss")], "balance loss")

    ax = axes[1, 0]
    has_grad = _panel(
        ax, records, steps, [("grad_norm", "grad norm")], "grad norm and learning rate", ylabel="grad norm", logy=True
    )
    lr = _nonfinite_aware(records, "lr")
    if lr is not None:
        if not has_grad:
            ax.texts[-1].remove()  # the "no grad_norm logged" note: the lr line fills the panel
            ax.set_ylabel("")
        ax2 = ax.twinx()
        ax2.plot(
            steps,
            lr[0],
            color="tab:orange",
            linewidth=1.2,
            marker="." if len(steps) < 50 else None,
            markersize=3,
            label="lr",
        )
        ax2.set_ylabel("learning rate", color="tab:orange")
        ax2.tick_params(axis="y", colors="tab:orange")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    _panel(axes[1, 1], records, steps, [("tokens_per_s", "tokens/s")], "throughput", ylabel="tokens/s")

    ax = axes[2, 0]
    ax.set_title("load imbalance per MoE layer (max / mean expert load)", fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    imb = _layers(records)
    if imb is None:
        _note(ax, "no load_imbalance logged")
    else:
        n = imb.shape[1]
        cmap, norm = colormaps["viridis"], Normalize(0, max(n - 1, 1))
        for j in range(n):
            ax.plot(
                steps,
                np.where(np.isfinite(imb[:, j]), imb[:, j], np.nan),
                color=cmap(norm(j)),
                linewidth=1,
                marker="." if len(steps) < 50 else None,
                markersize=3,
                label=_label(names, j),
            )
        ax.axhline(1.0, color="0.5", linestyle="--", linewidth=0.8)
        if n <= 12:
            ax.legend(fontsize=7, ncols=2 if n > 6 else 1)
        else:
            cb = fig.colorbar(
                ScalarMappable(norm=norm, cmap=cmap),
                ax=ax,
                pad=0.01,
                fraction=0.04,
                label="row: MoE layers in order, MTP last",
            )
            cb.locator = MaxNLocator(integer=True)
            cb.update_ticks()

    if any("mfu" in r for r in records) or not any("tflops_per_device" in r for r in records):
        _panel(axes[2, 1], records, steps, [("mfu", "MFU")], "model FLOPs utilization", ylabel="MFU")
    else:
        _panel(axes[2, 1], records, steps, [("tflops_per_device", "TFLOP/s per device")], "TFLOP/s per device")
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _label(names: Sequence[str], i: int) -> str:
    """A row's name for titles: its layer name, with the row index (the index of metrics.jsonl's lists and of the
    TensorBoard tags) when the two differ."""
    name = names[i] if i < len(names) else f"layer {i}"
    return name if name == f"layer {i}" else f"{name} (row {i})"


def _heat_layers(loads: ExpertLoads) -> list[int]:
    """The rows to draw as heat maps: all when few, else the HEATMAP_LAYERS with the highest mean busiest-expert
    share over the stored steps, worst first."""
    layers = loads.load.shape[1]
    if layers <= HEATMAP_LAYERS:
        return list(range(layers))
    score = np.nan_to_num(loads.busiest.mean(0), nan=-1.0)
    return sorted(range(layers), key=lambda i: (-score[i], i))[:HEATMAP_LAYERS]


def _columns(x: np.ndarray, z: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, z [steps, rows]) with at most MAP_COLUMNS steps: consecutive steps grouped evenly, each group drawn
    at its last step as the max (how="max", NaN ignored: a one-step collapse stays visible) or mean of its values."""
    if len(x) <= MAP_COLUMNS:
        return x, z
    starts = np.linspace(0, len(x), MAP_COLUMNS + 1).astype(np.int64)
    if how == "max":
        z = np.fmax.reduceat(z, starts[:-1], axis=0)
    else:
        z = np.add.reduceat(z, starts[:-1], axis=0) / np.diff(starts)[:, None]
    return x[starts[1:] - 1], z


def _edges(x: np.ndarray) -> np.ndarray:
    """Cell edges around the sorted steps x: halfway between neighbours, half a spacing beyond the ends (but not
    before step 0.5: the first stored step, 1, is followed by a whole loads_every gap)."""
    x = np.asarray(x, np.float64)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    first = max(x[0] - (mid[0] - x[0]), min(x[0], 1.0) - 0.5)
    return np.concatenate([[first], mid, [x[-1] + (x[-1] - mid[-1])]])


def _map(ax, x: np.ndarray, z: np.ndarray, norm, cmap, how: str, xbins: int | str = "auto"):
    """z [len(x), rows] as cells: steps on x, rows on y (row 0 at the bottom)."""
    x, z = _columns(x, z, how)
    mesh = ax.pcolormesh(_edges(x), np.arange(z.shape[1] + 1) - 0.5, z.T, norm=norm, cmap=cmap, rasterized=True)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=xbins, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(z.shape[1], 9)))
    return mesh


def _overview(fig, records: list[dict], steps: np.ndarray, loads: ExpertLoads) -> None:
    """Layers x steps: the busiest expert's share of tokens, and the router bias spread (max - min)."""
    names = loads.layer_names
    ax_share, ax_bias = fig.subplots(1, 2)
    share, x_share = _layers(records, "expert_max_share"), steps
    if share is None:  # metrics.jsonl without the statistics: the stored steps only
        share, x_share = loads.busiest, loads.steps
    lo, hi = _layers(records, "router_bias_min"), _layers(records, "router_bias_max")
    if lo is not None and hi is not None:
        spread, x_bias = hi - lo, steps
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no bias given
            spread, x_bias = np.nanmax(loads.bias, -1) - np.nanmin(loads.bias, -1), loads.steps
    by_name = FuncFormatter(lambda y, _: names[int(y)] if float(y).is_integer() and 0 <= y < len(names) else "")
    for ax, title in (
        (ax_share, "busiest expert's share of the layer's tokens (1 = every token)"),
        (ax_bias, "router bias spread (max - min) per layer"),
    ):
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel("MoE layer (MTP last)")
    m = _map(ax_share, x_share, share, _SHARE_NORM, _SHARE_CMAP, "max")
    ax_share.yaxis.set_major_formatter(by_name)
    fig.colorbar(m, ax=ax_share, pad=0.01, fraction=0.05)
    if np.isfinite(spread).any():
        top = float(np.nanmax(spread))
        m = _map(ax_bias, x_bias, spread, Normalize(0.0, top if top > 0 else 1.0), "viridis", "max")
        ax_bias.yaxis.set_major_formatter(by_name)
        fig.colorbar(m, ax=ax_bias, pad=0.01, fraction=0.05)
    else:
        _note(ax_bias, "no router bias logged")


def _heatmaps(fig, loads: ExpertLoads, chosen: list[int]) -> None:
    """One heat map per chosen row: each expert's share of the layer's tokens at every stored step."""
    cols = min(4, len(chosen))
    axes = fig.subplots(math.ceil(len(chosen) / cols), cols, squeeze=False).ravel()
    layers, experts = loads.load.shape[1:]
    k = loads.experts_per_token
    which = "every layer" if len(chosen) == layers else f"the {len(chosen)} most imbalanced of {layers} layers"
    fig.suptitle(
        f"load per expert over time: each expert's share of the layer's tokens, {which} "
        f"(top-{k} of {experts} experts: {k / experts:.3g} when balanced)",
        fontsize=10,
    )
    busiest = loads.busiest
    for ax, i in zip(axes, chosen):
        m = _map(ax, loads.steps, loads.share_of(i), _SHARE_NORM, _SHARE_CMAP, "mean", xbins=8 // cols + 2)
        title = f"{_label(loads.layer_names, i)}: busiest {busiest[-1, i]:.0%} (peak {busiest[:, i].max():.0%})"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("expert")
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    fig.colorbar(m, ax=list(axes[: len(chosen)]), pad=0.01, fraction=0.03, label="share of tokens")


def summary(run_dir) -> str:
    """One line: steps logged, first -> last loss, mean tokens/s (without the first record, which includes
    compilation, when there are more), skipped steps when any, and, when expert loads were logged, the most
    imbalanced layer at the last logged step. ValueError when there is no metrics.jsonl."""
    path = metrics_path(run_dir)
    records = _by_step(read_metrics(path))
    name = path.parent.name or str(path.parent)
    if not records:
        return f"{name}: no steps logged"
    first, last = records[0]["step"], records[-1]["step"]
    parts = [f"{name}: {len(records)} steps logged ({first}..{last})"]
    loss = [v for r in records if isinstance(v := r.get("loss"), (int, float)) and not isinstance(v, bool)]
    if loss:
        parts.append(f"loss {loss[0]:.4g} -> {loss[-1]:.4g}")
    tps = _nonfinite_aware(records, "tokens_per_s")
    if tps is not None:
        vals = tps[0][1:] if len(records) > 1 else tps[0]
        vals = vals[np.isfinite(vals)]
        if vals.size:
            parts.append(f"mean {vals.mean():,.0f} tokens/s")
    skipped = records[-1].get("skipped_steps")
    if isinstance(skipped, (int, float)) and skipped:
        parts.append(f"{skipped:g} skipped steps")
    overflowed = [sum(r["ep_overflow"]) for r in records if isinstance(r.get("ep_overflow"), list)]
    if any(overflowed):
        parts.append(
            f"expert-parallel buffers overflowed in {sum(map(bool, overflowed))} logged steps "
            f"({sum(overflowed)} further exchange rounds; raise model.ep_capacity to avoid them)"
        )
    worst = _worst_layer(path, records)
    if worst:
        parts.append(worst)
    return ", ".join(parts)


def _worst_layer(path: Path, records: list[dict]) -> str | None:
    """ "most imbalanced: layer 5 (row 2), busiest expert 97% of tokens, 14 of 16 experts idle" for the last record
    with expert_max_share; None when there is none."""
    logged = [r for r in records if isinstance(r.get("expert_max_share"), list)]
    if not logged:
        return None
    share = _layers(logged[-1:], "expert_max_share")[0]
    if not np.isfinite(share).any():
        return None
    i = int(np.nanargmax(share))
    names, experts = [], None
    if loads_path(path).exists():
        try:
            head = read_loads_header(loads_path(path))[0]
            names, experts = head["layer_names"], head["experts"]
        except ValueError:
            pass  # plot and read_expert_loads report a damaged file; the summary line still names the row
    text = f"most imbalanced: {_label(names, i)}, busiest expert {share[i]:.0%} of tokens"
    idle = logged[-1].get("experts_idle")
    if isinstance(idle, list) and i < len(idle) and isinstance(idle[i], int) and idle[i]:
        text += f", {idle[i]} of {experts} experts idle" if experts else f", {idle[i]} experts idle"
    return text
