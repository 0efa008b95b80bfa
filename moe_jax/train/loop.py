"""`moe-jax train`: continued pretraining (or training from scratch) of a DeepSeek-V3 model.

One jitted step: forward with MTP, loss = CE + lambda * MTP + alpha * balance, AdamW update of the
float32 master weights (computing in `compute_dtype`), then the aux-loss-free router bias update
outside the gradient. A step whose loss or gradient norm is not finite changes nothing and is
counted. Each step's metrics are read on the host only once the next step is dispatched
(`LaggedReader`), so the device always has a step queued. State (params, optimizer, router biases,
step) and the data position are checkpointed with Orbax; a resumed run continues bit for bit (the
data order is a function of seed and step, and nothing else in the step is random).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import yaml
from tqdm import tqdm

from converters.export import export_hf
from converters.jax_checkpoint import (
    Checkpoint,
    array_handlers,
    is_jax_checkpoint,
    save_model,
    side_files,
    sync_processes,
)
from converters.safetensors_io import CheckpointReader
from converters.tiny import tiny_config
from moe_jax import data
from moe_jax.config import DEEPSEEK_V3, DEEPSEEK_V32, ModelConfig
from moe_jax.errors import CheckpointError, ConfigError
from moe_jax.files import (
    FILES_RECORD,
    atomic_write,
    read_json_object,
    record_directory,
    refuse_overlap,
    remove,
    verify_directory,
)
from moe_jax.kernels.grouped_gemm import check_runs_here
from moe_jax.model import model_from_tree, remat_policy
from moe_jax.parallel.ep import ExpertParallel, check_transport, expert_axes
from moe_jax.params import init_tree, rule_of
from moe_jax.pretrained import load_converted, load_hf, without_mtp
from moe_jax.sharding import RULES, as_mesh, batch_sharding
from moe_jax.train import objective as obj
from moe_jax.train.config import TrainConfig
from moe_jax.train.metrics.writer import MetricsWriter
from moe_jax.train.preemption import PeerWatch, StopSignal, make_vote
from moe_jax.train.step import WarmupCosine, init_train_state, make_train_step
from moe_jax.train.throughput import peak_tflops


class TrainingError(RuntimeError):
    pass


# ---- the model to start from -------------------------------------------------------------------
@dataclasses.dataclass
class Start:
    """What `model.init` names, opened once: its config (parsed), and the checkpoint if any."""

    config: dict  # HF config.json contents
    model_cfg: ModelConfig
    description: str
    directory: Path | None = None  # a checkpoint directory (HF or converted)
    converted: Checkpoint | None = None  # a `moe-jax convert` checkpoint (manifest read and checked)
    reader: CheckpointReader | None = None  # an HF checkpoint (index and headers read)

    @property
    def extra_files(self) -> list[Path]:
        """The source's tokenizer/generation files, handed on to the export."""
        return side_files(self.directory) if self.directory is not None else []

    @property
    def extra_tensors(self) -> CheckpointReader | None:
        """The source's tensors besides the model (converters.extras), handed on to the export."""
        if self.converted is not None:
            return self.converted.extra_tensors()
        return self.reader


def open_start(cfg: TrainConfig) -> Start:
    m = cfg.model
    if m.init == "tiny":
        config, directory = tiny_config("base"), None
    elif m.init == "deepseek-v3":  # the 671B architecture, random weights (plans, benchmarks)
        config, directory = dict(DEEPSEEK_V3), None
    elif m.init == "deepseek-v3.2":  # the same with DeepSeek Sparse Attention
        config, directory = dict(DEEPSEEK_V32), None
    elif m.init.endswith(".json"):
        config, directory = read_json_object(m.init, "model.init config"), None
    else:
        directory = Path(m.init)
        if not (directory / "config.json").is_file():
            raise ConfigError(
                f"model.init: {m.init}: no config.json (expected a checkpoint directory, a config.json, 'tiny', "
                "'deepseek-v3' or 'deepseek-v3.2')"
            )
        if not m.random_init and is_jax_checkpoint(directory):
            ckpt = Checkpoint(directory)
            return Start(ckpt.config, ckpt.cfg, str(directory), directory, converted=ckpt)
        config = read_json_object(directory / "config.json", "model.init config")
        if not m.random_init:
            model_cfg = ModelConfig.from_hf_dict(config)
            reader = CheckpointReader(directory, model_cfg.tensor_prefix)
            return Start(config, model_cfg, str(directory), directory, reader=reader)
    return Start(config, ModelConfig.from_hf_dict(config), f"random init ({m.init})", directory)


def check_stage(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """dsa.stage warmup trains DeepSeek-V3.2's indexers: refused for a model without them."""
    if cfg.dsa.stage == "warmup" and not model_cfg.dsa:
        raise ConfigError(
            f"dsa.stage=warmup trains DeepSeek-V3.2's indexers, and {cfg.model.init} has none "
            f"({model_cfg.architecture}); leave dsa.stage at sparse"
        )


def load_start(start: Start, cfg: TrainConfig, mesh) -> tuple[dict, dict | None]:
    """(tree {params, buffers} as jax arrays, source dtypes by HF name or None for a random init)."""
    m = cfg.model
    mtp = None if m.mtp else False
    if start.converted is not None:
        model = load_converted(start.converted, m.param_dtype, mtp=mtp, mesh=mesh)
        source_dtypes = start.converted.source_dtypes()
    elif start.reader is not None:
        model = load_hf(start.reader, start.model_cfg, m.param_dtype, mtp=mtp, mesh=mesh)
        source_dtypes = dict(start.reader.dtypes)
    else:
        model = model_from_tree(start.model_cfg, init_tree(start.model_cfg, m.seed, m.param_dtype, m.mtp), mesh=mesh)
        source_dtypes = None
    tree = {"params": model.params, "buffers": model.buffers}
    return (tree if m.mtp else without_mtp(tree)), source_dtypes


def require_validation(cfg: TrainConfig, start: Start, log) -> None:
    """Refuse to train unless the starting checkpoint validates against its HF source."""
    from validation.layerwise import random_tokens, validate  # torch and transformers: only when asked

    if start.directory is None or cfg.model.random_init:
        raise ConfigError(
            "validate.required needs model.init to be a checkpoint (nothing to validate for a random init)"
        )
    converted = start.converted
    hf = cfg.validate.hf or (converted.source if converted else str(start.directory))
    tokens = random_tokens(start.model_cfg.vocab_size, 1, cfg.validate.tokens, 0)
    report = validate(hf, tokens, converted or start.directory, cfg.validate.dtype, progress=lambda *a: None)
    if not report["pass"]:
        raise TrainingError(
            f"validation of {start.directory} against {hf} failed (first failing layer: "
            f"{report['first_failing_layer']}); not training"
        )
    log(
        f"validation passed: {start.directory} against {hf} ({report['dtype']}, max |dlogit| {report['logits']['max_abs']:.3g}, "
        f"KL max {report['logits']['kl_max']:.3g})"
    )


# ---- optimizer ---------------------------------------------------------------------------------
def decay_mask(params: dict) -> dict:
    """Weight decay where the parameter table says so (matrices; not norms)."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: rule_of(("params", *(k.key for k in kp))).decay, params)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, WarmupCosine]:
    """Clipped AdamW of learning rate 1, and the learning-rate schedule the step applies to its
    updates (an input of the compiled step: runs that differ in lr or steps share a compilation)."""
    o = cfg.optim
    warmup = min(o.warmup_steps, cfg.steps - 1)
    schedule = WarmupCosine(o.lr, warmup, max(cfg.steps, warmup + 1), o.lr * o.min_lr_ratio)
    adamw = optax.adamw(1.0, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if o.moment_dtype is not None:
        adamw = state_stored_in(jnp.dtype(o.moment_dtype), adamw)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), schedule


def state_stored_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with its floating-point state (AdamW's moments) stored in `dtype` between steps and
    updated in float32: each step reads the stored moments as float32, updates them and rounds
    them back. DeepSeek-V3 trained with its AdamW moments in BF16 (its report, section 3.3.2);
    at 671B that halves 8 bytes a parameter of optimizer state."""

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


# ---- the step ----------------------------------------------------------------------------------
def expert_parallel(cfg: TrainConfig) -> ExpertParallel:
    """The MoE layers' expert-parallel options from the config's model section."""
    m = cfg.model
    return ExpertParallel(m.ep_capacity, m.ep_dispatch, m.ep_gradient_dispatch, chunk=m.ep_chunk)


def make_step(cfg: TrainConfig, model_cfg: ModelConfig, tx, schedule, mesh, state_shardings):
    """`make_train_step` configured by the run's config."""
    m, loss = cfg.model, cfg.loss
    return make_train_step(
        model_cfg,
        tx,
        mtp_lambda=loss.mtp_lambda,
        balance_alpha=loss.balance_alpha,
        bias_gamma=loss.bias_gamma,
        compute_dtype=m.compute_dtype,
        backend=m.backend,
        remat=m.remat,
        mesh=mesh,
        ep=expert_parallel(cfg),
        lr_schedule=schedule,
        state_shardings=state_shardings,
        grad_accum=cfg.optim.grad_accum,
        dsa_stage=cfg.dsa.stage,
        index_loss_weight=cfg.dsa.index_loss_weight,
    )


# ---- step checkpoints ---------------------------------------------------------------------------
def set_aside_unrecorded_checkpoints(ckpt_dir: Path, log) -> None:
    """Clear what a kill left behind: saves cut short (Orbax's temporary directories) are removed;
    saves that finished but whose integrity was never recorded cannot be checked, so they move
    to RUN/unverified-checkpoints/ (kept, never resumed from)."""
    for partial in ckpt_dir.glob("*.orbax-checkpoint-tmp*"):
        remove(partial)
    aside = ckpt_dir.parent / "unverified-checkpoints"
    for step_dir in sorted(ckpt_dir.iterdir()):
        if step_dir.name.isdigit() and step_dir.is_dir() and not (step_dir / FILES_RECORD).exists():
            aside.mkdir(exist_ok=True)
            remove(aside / step_dir.name)
            os.replace(step_dir, aside / step_dir.name)
            log(f"{step_dir}: no integrity record (the run stopped before it was written); moved to {aside}")


@dataclasses.dataclass
class Progress:
    """Where a run is, saved beside the state in every step checkpoint."""

    step: int = 0  # steps done (== batches consumed)
    skipped: int = 0  # steps whose loss or gradient was not finite
    bad_in_a_row: int = 0
    stopping: bool = False  # a process got SIGTERM or Ctrl-C: save after the step dispatched, and stop


class StepCheckpoints:
    """Orbax's manager for RUN/checkpoints/STEP, each recorded for integrity once its
    (asynchronous) save has finished, and verified before a resume reads it."""

    def __init__(self, ckpt_dir: Path, cfg: TrainConfig, lead: bool, log):
        self.dir, self.lead, self.log = ckpt_dir, lead, log
        if lead and ckpt_dir.is_dir():
            set_aside_unrecorded_checkpoints(ckpt_dir, log)
        sync_processes("train: checkpoints checked")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=cfg.checkpoint.async_save
        )
        self.manager = ocp.CheckpointManager(
            ckpt_dir,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(type_handler_registry=array_handlers()),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self.unrecorded: list[int] = []  # steps saved (perhaps still being written) without integrity records

    def to_resume(self, order: dict, steps: int) -> tuple[int, dict] | None:
        """(step, meta) of the latest checkpoint, or None if there is none, after the checks that
        need no model (so that a refused resume costs no load): its files are whole, it was taken
        over the same order of the data (`order`: batch_size, seed, num_rows, as
        `data.Batches.state` records them), and the run is not past `steps`."""
        latest = self.manager.latest_step()
        if latest is None:
            self.log(f"--resume: no checkpoint in {self.dir}; starting from step 0")
            return None
        step_dir = self.dir / str(latest)
        try:
            verify_directory(step_dir)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (to resume from an earlier checkpoint, remove {step_dir})") from None
        meta = self.manager.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        check_same_data(step_dir, meta["data"], order)
        if meta["data"]["step"] > steps:
            raise ConfigError(f"{step_dir}: the run is past steps={steps}; resume with steps >= {meta['data']['step']}")
        return latest, meta

    def restore(self, latest: int, meta: dict, state: dict) -> tuple[dict, Progress]:
        """Checkpoint `latest` (from `to_resume`) into the layout of `state`, after checking that it
        holds the same arrays (the same model and optimizer): otherwise resuming would mix two runs."""
        step_dir = self.dir / str(latest)
        check_same_arrays(step_dir, self.manager.item_metadata(latest)["state"], state)
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = self.manager.restore(
            latest,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
            ),
        )
        self.log(f"resumed from {step_dir} (step {meta['data']['step']})")
        return restored["state"], Progress(meta["data"]["step"], meta["skipped_steps"], meta["nonfinite_in_a_row"])

    def save(self, state: dict, progress: Progress, data_state: dict) -> None:
        self.record_saved(wait=True)  # Orbax waits for the previous save before starting one anyway
        meta = {"data": data_state, "skipped_steps": progress.skipped, "nonfinite_in_a_row": progress.bad_in_a_row}
        self.manager.save(
            progress.step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
        )
        self.unrecorded.append(progress.step)

    def record_saved(self, wait: bool) -> None:
        """Integrity records for the checkpoints whose save has finished."""
        if wait:
            self.manager.wait_until_finished()  # every process: Orbax may synchronize them here
        elif not self.unrecorded or self.manager.is_saving_in_progress():
            return
        while self.unrecorded:
            step_dir = self.dir / str(self.unrecorded.pop())
            if self.lead and step_dir.is_dir():  # (Orbax may already have deleted an old one)
                record_directory(step_dir)

    def close(self) -> None:
        self.record_saved(wait=True)
        self.manager.close()


RESUME_HINT = "resume with the settings it was written with, or start a new run_dir (model.init can be RUN/model)"


def check_same_data(step_dir: Path, saved: dict, now: dict) -> None:
    """The checkpoint's data order (batch size, seed, rows and what they hold) is this run's: its
    step is a position in it. (A checkpoint written before rows were fingerprinted is not asked.)"""
    if "fingerprint" in saved and saved["fingerprint"] != now["fingerprint"]:
        raise ConfigError(
            f"{step_dir}: written over other data (data.source, data.seq_len or the tokenizer differ: "
            f"its rows are not this run's): {RESUME_HINT}"
        )
    for key, name in (("batch_size", "data.batch_size"), ("seed", "data.seed"), ("num_rows", "the data's rows")):
        if saved.get(key) != now[key]:
            raise ConfigError(
                f"{step_dir}: written with {name}={saved.get(key)}, this run has {now[key]}; "
                f"its step would point into another order of the data: {RESUME_HINT}"
            )


def check_same_arrays(step_dir: Path, stored, state: dict) -> None:
    """The checkpoint holds the arrays of `state`, by path and shape."""

    def shapes(tree) -> dict[str, tuple[int, ...]]:  # by path, however each level is keyed (a stored
        # tuple of the optimizer's state comes back as a list, its named fields as dict keys)
        def name(k) -> str:
            return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))

        return {".".join(map(name, p)): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = shapes(stored), shapes(state)
    for path in sorted(have.keys() | want.keys(), key=lambda p: (not p.startswith("params"), p)):
        if have.get(path) != want.get(path):
            there, here = (f"{d[path]}" if path in d else "absent" for d in (have, want))
            raise ConfigError(
                f"{step_dir}: holds another model or optimizer: {path} is {there} there and {here} "
                f"in this run: {RESUME_HINT}"
            )


# ---- the run -----------------------------------------------------------------------------------
def prepare_run_dir(cfg: TrainConfig, resume: bool) -> tuple[Path, list[str]]:
    """(the run directory, the inputs it must not overlap); refuses a second run into it."""
    run = Path(cfg.run_dir).absolute()
    ckpt_dir = run / "checkpoints"
    have = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    if have and not resume:
        raise ConfigError(f"{run}: has checkpoints (steps {have}); pass --resume to continue, or use another run_dir")
    inputs = [p for p in (cfg.model.init, cfg.data.tokenizer) if p and Path(p).exists()]
    refuse_overlap(run, inputs, flag="run_dir")  # the run's outputs never replace what it reads
    for root, reach in data.source_roots(cfg.data.source):  # nor become its data
        inside = run.resolve().is_relative_to(root.resolve())
        if inside and (reach is None or len(run.resolve().relative_to(root.resolve()).parts) < reach):
            raise ConfigError(
                f"{run}: run_dir is inside data.source's {root}: the run's own files would be read as data; "
                "choose another run_dir"
            )
    return run, inputs


def keep_previous_config(run: Path, cfg: TrainConfig, step: int) -> None:
    """RUN/config.yaml: this run's config; a resumed run's earlier one, if it differs, is kept as
    RUN/config-until-step-N.yaml (what steps 1..N ran with)."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    previous = run / "config.yaml"
    if step and previous.is_file() and previous.read_text() != text:
        os.replace(previous, run / f"config-until-step-{step}.yaml")
    atomic_write(previous, text)


def open_dataset(cfg: TrainConfig, start: Start) -> data.PackedDataset:
    """The packed rows of data.source, tokenized by data.tokenizer (else the starting checkpoint's
    tokenizer, else bytes); at least one batch of them."""
    tokenizer_dir = cfg.data.tokenizer or (start.extra_files[0].parent if start.extra_files else None)
    try:
        tokenizer = data.load_tokenizer(tokenizer_dir, start.model_cfg.vocab_size, required=bool(cfg.data.tokenizer))
    except FileNotFoundError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    stream = data.load_stream(cfg.data.source, tokenizer)
    dataset = data.PackedDataset(stream, cfg.data.seq_len, tokenizer.eos_id, source=f"data.source={cfg.data.source}")
    if len(dataset) < cfg.data.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is more than data.source's {len(dataset)} rows of "
            f"data.seq_len + 1 = {cfg.data.seq_len + 1} tokens"
        )
    return dataset


def check_batch_split(cfg: TrainConfig, mesh) -> None:
    """Every micro-batch (data.batch_size / optim.grad_accum sequences) splits evenly over the
    mesh's batch axes: otherwise devices would compute each other's rows again, and several
    processes could not each feed their own share of the batch."""
    if mesh is None:
        return
    axes = {a: n for a, n in mesh.shape.items() if a in RULES["batch"]}
    ways, micro = math.prod(axes.values()), cfg.data.batch_size // cfg.optim.grad_accum
    if micro % ways:
        split = " x ".join(f"{a}={n}" for a, n in axes.items()) + (f" = {ways}" if len(axes) > 1 else "")
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} (micro-batches of {micro} with optim.grad_accum="
            f"{cfg.optim.grad_accum}) does not split over the mesh's batch axes ({split}): "
            f"use a multiple of {ways * cfg.optim.grad_accum}, or another mesh"
        )


def batch_placer(cfg: TrainConfig, mesh):
    """Host batch -> device arrays (split over the mesh's batch axes), with positions added."""

    def place(batch: dict) -> dict:
        batch = {**batch, "positions": data.positions_from_segments(batch["segment_ids"][:, :-1])}
        if mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {
            k: jax.make_array_from_process_local_data(batch_sharding(mesh, (cfg.data.batch_size,) + v.shape[1:]), v)
            for k, v in batch.items()
        }

    return place


def train(
    cfg: TrainConfig, resume: bool = False, progress: bool = True, log=print, stop: StopSignal | None = None
) -> dict:
    """Run `cfg`: open and check everything, then step, log, checkpoint, and save the final model
    (and its HF export). SIGTERM or Ctrl-C (`stop`, installed here if not given) saves a checkpoint on every
    process after the same step and returns early, `preempted_at` the step. Returns {run, model,
    losses, skipped_steps, final_loss, preempted_at}."""
    lead = jax.process_index() == 0
    if not lead:
        log = lambda *a: None  # noqa: E731  (one process speaks)
    run, inputs = prepare_run_dir(cfg, resume)
    remat_policy(cfg.model.remat)  # fail early on a bad name
    try:
        check_runs_here(cfg.model.backend)
    except ValueError as e:
        raise ConfigError(f"model.backend: {e}") from None
    mesh = as_mesh(cfg.mesh)
    check_batch_split(cfg, mesh)
    if mesh is not None and expert_axes(mesh):  # the MoE layers run expert-parallel
        try:
            check_transport(expert_parallel(cfg))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    start = open_start(cfg)
    check_stage(cfg, start.model_cfg)
    dataset = open_dataset(cfg, start)  # bad data fails before the validation gate's minutes and the load
    tx, schedule = make_optimizer(cfg)

    checkpoints = StepCheckpoints(run / "checkpoints", cfg, lead, log)
    try:
        order = {
            "batch_size": cfg.data.batch_size,
            "seed": cfg.data.seed,
            "num_rows": len(dataset),
            "fingerprint": dataset.fingerprint,
        }
        resuming = checkpoints.to_resume(order, cfg.steps) if resume else None
        if cfg.validate.required:
            require_validation(cfg, start, log)
        tree, source_dtypes = load_start(start, cfg, mesh)
        state = init_train_state(tree, tx, mesh)
        state, at = checkpoints.restore(*resuming, state) if resuming else (state, Progress())
    except BaseException:
        checkpoints.close()
        raise
    if at.step == cfg.steps:
        log(f"nothing to do: at step {at.step} of {cfg.steps}")
    if lead:
        run.mkdir(parents=True, exist_ok=True)
        keep_previous_config(run, cfg, at.step)
    # the CLI starts the watch as soon as the process has joined; a direct caller gets one here
    watch = PeerWatch(cfg.peer_timeout_s) if jax.process_count() > 1 and not PeerWatch.current else nullcontext()
    with nullcontext(stop) if stop else StopSignal() as stop, watch:
        try:
            state, losses = run_steps(
                cfg, start, state, dataset, tx, schedule, mesh, checkpoints, at, run, progress, log, stop
            )
        finally:
            checkpoints.close()
        result = {"run": str(run), "losses": losses, "skipped_steps": at.skipped, "preempted_at": None}
        if at.stopping and at.step < cfg.steps:
            saved = run / "checkpoints" / str(at.step)
            log(
                f"stop requested (SIGTERM or Ctrl-C): every process stopped after step {at.step}"
                + (f" (checkpoint {saved})" if saved.is_dir() else "")
                + "; run again with --resume to continue"
            )
            return {**result, "model": None, "final_loss": math.nan, "preempted_at": at.step}
        model_dir = save_model(
            run / "model",
            start.config,
            {"params": state["params"], "buffers": state["buffers"]},
            source=f"{start.description}, trained {cfg.steps} steps",
            source_dtypes=source_dtypes,
            hf_files=start.extra_files,
            extras=start.extra_tensors,
            scales_from=start.converted,
            inputs=inputs,
        )
        if cfg.export_dtype and lead:
            export_hf(model_dir, run / "hf", dtype=cfg.export_dtype, force=True, progress=False)
    return {**result, "model": str(model_dir), "final_loss": losses.get(cfg.steps, math.nan)}


class LaggedReader:
    """Reads each step's metrics after the next step was dispatched.

    Reading a step's metrics on the host (device_get, then logging, progress and the non-finite
    guard) waits until the device has run it; read right away, the device would sit idle until the
    host had queued the next step. So the loop dispatches step n + 1 (a jitted call that returns at
    once, its results futures) before it reads step n, and reads n while n + 1 runs. `flush` reads
    the pending step before a checkpoint and at the end (the last step is one). A non-finite step
    changes nothing in the graph, so step n + 1 starts from the state it always would; when the
    guard stops the run on step n, n + 1 is dropped unread and nothing is saved.

    The step time is from the later of the step's dispatch and the previous step's read to its own
    read: with steps queued back to back, the interval between reads.
    """

    def __init__(self, read):
        self.read = read  # read(step, metrics on the host, step time in seconds)
        self.pending: tuple[int, dict, float] | None = None  # (step, device metrics, when its dispatch began)
        self.last_read = -math.inf

    def dispatched(self, step: int, metrics: dict, t0: float) -> None:
        """Step `step` (counted from 1) was dispatched at `t0`, giving `metrics`: read the pending one."""
        pending, self.pending = self.pending, (step, metrics, t0)
        if pending:
            self._read(*pending)

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending:
            self._read(*pending)

    def _read(self, step: int, metrics: dict, t0: float) -> None:
        metrics = jax.device_get(metrics)  # waits for the step
        now = time.perf_counter()
        dt, self.last_read = now - max(t0, self.last_read), now
        self.read(step, metrics, dt)


def run_steps(
    cfg: TrainConfig,
    start: Start,
    state: dict,
    dataset,
    tx,
    schedule,
    mesh,
    checkpoints: StepCheckpoints,
    at: Progress,
    run: Path,
    progress: bool,
    log,
    stop: StopSignal,
) -> tuple[dict, dict[int, float]]:
    """Steps `at.step` .. `cfg.steps`: each logged, checkpointed every `checkpoint.every` steps and
    at the end, or at once when a process has received SIGTERM (`stop`; then `at.stopping` is
    set). Updates `at`; returns the final state and the loss of every step run."""
    model_cfg = start.model_cfg
    lead = jax.process_index() == 0
    batches = data.batches(
        dataset, cfg.data.batch_size, cfg.data.seed, jax.process_index(), jax.process_count(), at.step
    )
    step_fn = make_step(cfg, model_cfg, tx, schedule, mesh, jax.tree.map(lambda x: x.sharding, state))
    place = batch_placer(cfg, mesh)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = obj.flops_per_token(model_cfg, cfg.data.seq_len, cfg.model.mtp, cfg.dsa.stage) * tokens_per_step
    peak, peak_source = peak_tflops(cfg.peak_tflops)
    n_dev = jax.device_count()
    writer = MetricsWriter(run, tensorboard=cfg.tensorboard, resume_step=at.step) if lead else None
    log(
        f"training {start.description}: {sum(x.size for x in jax.tree.leaves(state['params'])) / 1e6:.2f}M params, "
        f"{len(dataset)} sequences of {cfg.data.seq_len} tokens, {n_dev} device(s) in {jax.process_count()} "
        f"process(es), peak {peak:.3g} TFLOP/s "
        f"per device ({peak_source})"
    )

    losses = {}
    bar = tqdm(total=cfg.steps, initial=at.step, desc="train", unit="step", disable=not (progress and lead))

    def read_step(step: int, metrics: dict, dt: float) -> None:
        """Step `step`'s metrics, on the host: progress, log, the non-finite guard."""
        finite = bool(metrics.pop("finite"))
        requested = bool(metrics.pop("stop_requested"))  # (not a metric: never recorded)
        at.stopping = at.stopping or requested
        at.step, at.skipped = step, at.skipped + (not finite)
        at.bad_in_a_row = 0 if finite else at.bad_in_a_row + 1
        tflops = flops_per_step / dt / n_dev / 1e12
        expert_load, router_bias = metrics.pop("expert_load"), metrics.pop("router_bias")
        per_layer = ("load_imbalance", "ep_overflow")
        record = {k: float(v) for k, v in metrics.items() if k not in per_layer}
        record.update(
            load_imbalance=[float(x) for x in metrics["load_imbalance"]],
            ep_overflow=[int(x) for x in metrics["ep_overflow"]],  # further expert-parallel exchange rounds
            tokens_per_s=tokens_per_step / dt,
            step_time_s=dt,
            tflops_per_device=tflops,
            mfu=tflops / peak,
            skipped_steps=at.skipped,
        )
        losses[at.step] = record["loss"]
        if writer and (at.step % cfg.log_every == 0 or at.step == cfg.steps):
            n_moe, dense = model_cfg.num_moe_layers, model_cfg.num_dense_layers
            writer.write(
                at.step,
                record,
                expert_load=expert_load,
                router_bias=router_bias,
                experts_per_token=model_cfg.num_experts_per_tok,
                layer_names=[
                    f"layer {dense + i}" if i < n_moe else f"MTP {i - n_moe}" for i in range(len(expert_load))
                ],
                # full loads: the first step, then one per loads_every steps (default ~1000 a run), and the last
                loads_every=1 if at.step == cfg.steps else cfg.loads_every or math.ceil(cfg.steps / 1000),
            )
        if at.bad_in_a_row >= cfg.optim.max_nonfinite:
            raise TrainingError(
                f"step {at.step}: loss or gradient not finite for {at.bad_in_a_row} steps in a row "
                f"(optim.max_nonfinite); stopping. Lower optim.lr or check the data."
            )
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", step_s=f"{dt:.2f}")
        bar.update(1)

    lagged = LaggedReader(read_step)
    vote = make_vote()  # was any process asked to stop? read with the step's metrics, the same everywhere
    if at.step < cfg.steps and vote(stop.requested):  # during startup: nothing new to save
        at.stopping = True
        return state, losses
    try:
        for step in range(at.step, cfg.steps):
            t0 = time.perf_counter()
            state, metrics = step_fn(state, place(next(batches)))  # batch `step`
            metrics = {**metrics, "stop_requested": vote(stop.requested)}
            lagged.dispatched(step + 1, metrics, t0)  # reads the previous step while this one runs
            if at.stopping or (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.steps:
                lagged.flush()  # a checkpoint holds only steps read (and so let through by the guard)
                checkpoints.save(state, at, batches.state)  # data step == step
            checkpoints.record_saved(wait=False)
            if at.stopping:
                break
    finally:
        bar.close()
        if writer:
            writer.close()
    return state, losses
