"""`moe-jax train` configuration: a YAML file plus `section.key=value` overrides.

Every key and its default is below; an unknown key or a value of the wrong type is an error
that names it. See configs/tiny.yaml for a complete example.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from pathlib import Path

import yaml

from moe_jax.errors import ConfigError
from moe_jax.kernels.grouped_gemm import resolve_backend
from moe_jax.model import REMAT_POLICIES
from moe_jax.parallel.ep import DISPATCH_DTYPES
from moe_jax.params import PARAM_DTYPES
from moe_jax.train.xla import PRESETS, parse_flags


@dataclasses.dataclass
class ModelSection:
    init: str = "tiny"  # a converted checkpoint, an HF directory, a config.json, or built-in: "tiny", "deepseek-v3", "deepseek-v3.2"
    random_init: bool = False  # with an HF dir/converted checkpoint: take only its config, random weights
    mtp: bool = True  # train the MTP layers when the config has them
    param_dtype: str = "float32"  # master weights (and optimizer state)
    compute_dtype: str = "bfloat16"  # activations and matmul inputs
    backend: str | None = None  # grouped-GEMM backend (None: the platform default)
    remat: str = "none"  # none | full | dots | save_qv | offload_qv | save_dispatch (see moe_jax.model.REMAT_POLICIES)
    ep_capacity: float = 1.25  # expert-parallel receive buffers per round, over the balanced load
    ep_dispatch: str = "bfloat16"  # dispatched rows' payload: bfloat16 (the compute dtype) | float8
    ep_gradient_dispatch: str = "bfloat16"  # the backward's gradients sent to the experts: bfloat16 | float8
    ep_chunk: int | None = None  # tokens a device runs through each MoE layer at a time (None: all; long context)
    seed: int = 0  # random init


@dataclasses.dataclass
class DataSection:
    source: typing.Any = "python-docs"  # python-docs, files/dirs/globs (txt, jsonl, parquet, npy), or a list
    tokenizer: str | None = None  # dir (or file) of tokenizer.json / tiktoken.model (default: the checkpoint's)
    seq_len: int = 128  # tokens a sequence (rows of seq_len + 1 tokens: inputs and shifted targets)
    batch_size: int = 8  # global, in sequences
    seed: int = 0  # seed of the shuffle (batch n depends only on it and n)


@dataclasses.dataclass
class OptimSection:
    lr: float = 3e-3  # peak learning rate, after the linear warmup
    warmup_steps: int = 10  # steps of linear warmup from 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # not applied to norms, biases and the router bias
    clip_norm: float = 1.0  # global gradient norm
    max_nonfinite: int = 5  # consecutive NaN/Inf steps (skipped) before the run stops
    grad_accum: int = 1  # micro-batches per step (data.batch_size of them in all): one update a step
    moment_dtype: str | None = (
        None  # AdamW's moments as stored (None: the parameters' dtype; DeepSeek-V3 kept bfloat16)
    )


@dataclasses.dataclass
class LossSection:
    mtp_lambda: float = 0.3  # weight of the MTP loss (DeepSeek-V3: 0.3, then 0.1)
    balance_alpha: float = 1e-4  # sequence-wise balance loss weight, per MoE layer
    bias_gamma: float = 1e-3  # aux-loss-free bias update speed (0: off)


@dataclasses.dataclass
class DsaSection:
    stage: str = "sparse"  # DeepSeek-V3.2: warmup (dense attention, only the indexers train) | sparse (top-k attention, all train)
    index_loss_weight: float = 1.0  # weight of the indexers' KL loss (it reaches the indexers alone)


DSA_STAGES = ("warmup", "sparse")


@dataclasses.dataclass
class CheckpointSection:
    every: int = 50  # steps between checkpoints (and one at the end)
    keep: int = 3  # last K kept
    async_save: bool = True  # save in the background (Orbax asynchronous checkpointing)


@dataclasses.dataclass
class ValidateSection:
    required: bool = False  # validate the starting checkpoint against its HF source before training
    hf: str | None = None  # the HF source (default: the checkpoint itself if HF, else its manifest's source)
    tokens: int = 64  # length of the random token sequence the gate validates on
    dtype: str | None = None  # float32 | bfloat16 (None: the checkpoint's parameter dtype)


@dataclasses.dataclass
class TrainConfig:
    run_dir: str = "runs/train"  # the run's directory: checkpoints, metrics, the final model (`RUN/model`)
    steps: int = 40  # optimizer steps in the run (the cosine schedule ends at the last)
    log_every: int = 1  # steps between metric records (and the last step)
    loads_every: int | None = None  # steps between stored per-expert loads (None: ~1000 a run)
    mesh: str | None = None  # e.g. "data=2,expert=4"; None: one device
    xla_preset: str | None = None  # see moe_jax.train.xla.PRESETS
    xla_flags: str | None = None  # more XLA flags, "--name=value ...", over the preset's (XLA_FLAGS wins)
    peak_tflops: float | None = None  # per device, for MFU (None: known GPU table, or measured on CPU)
    tensorboard: bool = True  # also write the metrics as TensorBoard events (`RUN/tensorboard`)
    export_dtype: str | None = None  # after training, also export RUN/hf (bfloat16 | float32 | fp8 | source)
    peer_timeout_s: float = 120.0  # multi-process: a process silent this long stops the others, named
    join_timeout_s: float = 600.0  # multi-process: a run not formed this long after start stops, with one line
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    loss: LossSection = dataclasses.field(default_factory=LossSection)
    dsa: DsaSection = dataclasses.field(default_factory=DsaSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    validate: ValidateSection = dataclasses.field(default_factory=ValidateSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(where: str, value, hint):
    """Check/convert a YAML or command-line value against the field's type."""
    args = set(typing.get_args(hint)) or {hint}
    if value is None:
        if type(None) in args or hint is typing.Any:
            return None
        raise ConfigError(f"{where}: may not be null")
    if hint is typing.Any:
        return value
    for t in (bool, int, float, str):
        if t in args:
            if t is bool and isinstance(value, bool):
                return value
            if t is int and isinstance(value, int) and not isinstance(value, bool):
                return value
            if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if t is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
                try:
                    return float(value)
                except ValueError:
                    pass
            if t is str and isinstance(value, str):
                return value
    raise ConfigError(f"{where}: expected {' or '.join(sorted(a.__name__ for a in args))}, got {value!r}")


def _fill(obj, values: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        where = prefix + key
        if key not in hints:
            known = ", ".join(prefix + k for k in hints)
            raise ConfigError(f"unknown config key {where!r} (known: {known})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping")
            _fill(current, value, where + ".")
        else:
            setattr(obj, key, _coerce(where, value, hints[key]))


def parse_override(text: str) -> dict:
    """ "optim.lr=1e-3" -> {"optim": {"lr": 0.001}} (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value of {key.strip()} is {yaml_error(e)}") from None
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value


def yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's error as one line with the line and column where it was found (1-based)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"not valid YAML: {where}{problem}"


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last:
    a repeated section would silently replace the first one whole)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    cfg = TrainConfig()
    if path is not None:
        path = Path(path)
        try:
            values = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: {yaml_error(e)}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        try:
            _fill(cfg, values)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for text in overrides:
        _fill(cfg, parse_override(text))
    check_ranges(cfg)
    check_names(cfg)
    check_source(cfg)
    return cfg


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _at_least_1(v) -> bool:
    return v >= 1


# key -> (valid?, what a valid value is); null is valid for a key that may be null
RANGES = {
    "steps": (_at_least_1, ">= 1"),
    "log_every": (_at_least_1, ">= 1"),
    "loads_every": (_at_least_1, ">= 1 (or null: about 1000 stored steps a run)"),
    "peer_timeout_s": (_positive, "> 0"),
    "join_timeout_s": (_positive, "> 0"),
    "peak_tflops": (_positive, "> 0 (or null)"),
    "model.ep_capacity": (_positive, "> 0"),
    "model.ep_chunk": (_at_least_1, ">= 1 (tokens) or null"),
    "model.seed": (_non_negative, ">= 0"),
    "data.seq_len": (lambda v: v >= 2, ">= 2"),
    "data.batch_size": (_at_least_1, ">= 1"),
    "data.seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),  # the data shuffle's seed
    "optim.lr": (_non_negative, ">= 0"),
    "optim.warmup_steps": (_non_negative, ">= 0"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "optim.b1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.eps": (_positive, "> 0"),
    "optim.weight_decay": (_non_negative, ">= 0"),
    "optim.clip_norm": (_positive, "> 0"),
    "optim.max_nonfinite": (_at_least_1, ">= 1"),
    "optim.grad_accum": (_at_least_1, ">= 1"),
    "loss.mtp_lambda": (_non_negative, ">= 0"),
    "loss.balance_alpha": (_non_negative, ">= 0"),
    "loss.bias_gamma": (_non_negative, ">= 0"),
    "dsa.index_loss_weight": (_non_negative, ">= 0"),
    "checkpoint.every": (_at_least_1, ">= 1"),
    "checkpoint.keep": (_at_least_1, ">= 1"),
    "validate.tokens": (_at_least_1, ">= 1"),
}


def check_ranges(cfg: TrainConfig) -> None:
    """Every number of the config in its range, and the mesh's axis sizes (before anything runs)."""
    for key, (valid, what) in RANGES.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if not valid(value):
            raise ConfigError(f"{key} must be {what}, got {value}")
    if cfg.data.batch_size % cfg.optim.grad_accum:
        raise ConfigError(
            f"optim.grad_accum must be >= 1 and divide data.batch_size ({cfg.data.batch_size}), got {cfg.optim.grad_accum}"
        )
    if cfg.mesh is not None:  # (the rest of the spec is read by moe_jax.sharding.mesh_from_spec)
        sizes = [part.partition("=")[2].strip() for part in cfg.mesh.split(",")]
        for size in sizes:
            if size.lstrip("-").isdigit() and int(size) < 1 and size != "-1":
                raise ConfigError(f"mesh {cfg.mesh!r}: an axis size must be >= 1 (or -1: the rest of the devices)")
        if sizes.count("-1") > 1:
            raise ConfigError(f"mesh {cfg.mesh!r}: at most one axis may be -1 (the rest of the devices)")


def check_source(cfg: TrainConfig) -> None:
    """data.source is a path, pattern or built-in name, or a list of them (what they name is read later)."""
    source = cfg.data.source
    items = source if isinstance(source, list) and source else [source]
    if not all(isinstance(item, str) and item for item in items):
        raise ConfigError(
            f"data.source: expected a file, directory, glob pattern or built-in name, or a list of them, got {source!r}"
        )


def check_names(cfg: TrainConfig) -> None:
    """Every key that names a choice names a known one (before anything runs)."""
    choices = {
        "model.param_dtype": (cfg.model.param_dtype, PARAM_DTYPES),
        "model.compute_dtype": (cfg.model.compute_dtype, PARAM_DTYPES),
        "optim.moment_dtype": (cfg.optim.moment_dtype, (None, *PARAM_DTYPES)),
        "model.remat": (cfg.model.remat, tuple(REMAT_POLICIES)),
        "model.ep_dispatch": (cfg.model.ep_dispatch, DISPATCH_DTYPES),
        "model.ep_gradient_dispatch": (cfg.model.ep_gradient_dispatch, DISPATCH_DTYPES),
        "validate.dtype": (cfg.validate.dtype, (None, "float32", "bfloat16")),
        "export_dtype": (cfg.export_dtype, (None, "source", "bfloat16", "float32", "fp8")),
        "xla_preset": (cfg.xla_preset, (None, *PRESETS)),
        "dsa.stage": (cfg.dsa.stage, DSA_STAGES),
    }
    for key, (value, known) in choices.items():
        if value not in known:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(str(k) for k in known)}")
    try:
        parse_flags(cfg.xla_flags)
    except ValueError as e:
        raise ConfigError(f"xla_flags: {e}") from None
    if cfg.model.backend is not None:
        try:
            resolve_backend(cfg.model.backend)
        except ValueError as e:
            raise ConfigError(f"model.backend: {e}") from None
