"""`moe-jax train`: continued pretraining (or training from scratch) of a DeepSeek-V3 model.

One jitted step: forward with MTP, loss = CE + lambda * MTP + alpha * balance, AdamW update of the
float32 master weights (computing in `compute_dtype`), then the aux-loss-free router bias update
outside the gradient. A step whose loss or gradient norm is not finite changes nothing and is
counted. State (params, optimizer, router biases, step) and the data position are checkpointed
with Orbax; a resumed run continues bit for bit (the data order is a function of seed and step,
and nothing else in the step is random).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from converters.files import (FILES_RECORD, atomic_write, read_json_object, record_directory, refuse_overlap, remove,
                              verify_directory)  # fmt: skip
from converters.jax_checkpoint import sync_processes
from moe_jax.config import ModelConfig
from moe_jax.errors import CheckpointError
from moe_jax.model import forward, model_from_tree, remat_policy
from moe_jax.params import init_tree, rule_of
from moe_jax.train import objective as obj
from moe_jax.train.config import ConfigError, TrainConfig


class TrainingError(RuntimeError):
    pass


# ---- the model to start from -------------------------------------------------------------------
def starting_point(cfg: TrainConfig, mesh) -> tuple[dict, dict, dict | None, list[Path], str]:
    """(HF config dict, tree {params, buffers} as jax arrays, source dtypes by HF name or None,
    the source's tokenizer/generation files, a description of the source)."""
    from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint, side_files
    from converters.tiny import tiny_config
    from moe_jax.pretrained import from_pretrained

    m = cfg.model
    init = m.init
    if init == "tiny":
        config, directory = tiny_config("base"), None
    elif init.endswith(".json"):
        config, directory = read_json_object(init, "model.init config"), None
    else:
        directory = Path(init)
        if not (directory / "config.json").is_file():
            raise ConfigError(f"model.init: {init}: no config.json (expected a checkpoint directory, 'tiny' or a config.json)")
        config = None
    source_dtypes = None
    if directory is None or m.random_init:
        if config is None:
            config = read_json_object(directory / "config.json", "model.init config")
        model_cfg = ModelConfig.from_hf_dict(config)
        tree = init_tree(model_cfg, seed=m.seed, dtype=m.param_dtype, mtp=m.mtp)
        model = model_from_tree(model_cfg, tree, mesh=mesh)
        description = f"random init ({init})"
    else:
        model = from_pretrained(directory, dtype=m.param_dtype, mtp=None if m.mtp else False, mesh=mesh)
        config = model.config.to_hf_dict()
        description = str(directory)
        if is_jax_checkpoint(directory):
            source_dtypes = Checkpoint(directory, verify=False).source_dtypes()
        else:
            from converters.safetensors_io import CheckpointReader

            source_dtypes = dict(CheckpointReader(directory).dtypes)
    tree = {"params": model.params, "buffers": model.buffers}
    if not m.mtp:
        tree = {k: {n: v for n, v in sub.items() if n != "mtp"} for k, sub in tree.items()}
    extra_files = side_files(directory) if directory is not None else []  # handed on to the export
    return config, tree, source_dtypes, extra_files, description


def require_validation(cfg: TrainConfig, log) -> None:
    """Refuse to train unless the starting checkpoint validates against its HF source."""
    from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint
    from validation.layerwise import validate

    init = Path(cfg.model.init)
    if cfg.model.init == "tiny" or cfg.model.random_init or not init.is_dir():
        raise ConfigError("validate.required needs model.init to be a checkpoint (nothing to validate for a random init)")
    converted = Checkpoint(init, verify=False) if is_jax_checkpoint(init) else None
    hf = cfg.validate.hf or (converted.source if converted else str(init))
    dtype = cfg.validate.dtype or (converted.dtype if converted else "float32")
    tokens = np.random.default_rng(0).integers(0, ModelConfig.from_json(init).vocab_size, (1, cfg.validate.tokens))
    report = validate(hf, tokens.astype(np.int32), init if converted else None, dtype, progress=lambda *a: None)
    if not report["pass"]:
        raise TrainingError(f"validation of {init} against {hf} failed (first failing layer: "
                            f"{report['first_failing_layer']}); not training")  # fmt: skip
    log(f"validation passed: {init} against {hf} ({dtype}, max |dlogit| {report['logits']['max_abs']:.3g}, "
        f"KL max {report['logits']['kl_max']:.3g})")  # fmt: skip


# ---- optimizer ---------------------------------------------------------------------------------
def decay_mask(params: dict) -> dict:
    """Weight decay where the parameter table says so (matrices; not norms)."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: rule_of(("params", *(k.key for k in kp))).decay, params)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optim
    warmup = min(o.warmup_steps, cfg.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(cfg.steps, warmup + 1), o.lr * o.min_lr_ratio)
    adamw = optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), schedule


# ---- the step ----------------------------------------------------------------------------------
def make_step(cfg: TrainConfig, model_cfg: ModelConfig, tx, schedule, mesh, state_shardings):
    """The jitted step. Its state comes back with exactly the shardings it went in with, so the
    second step reuses the first step's compilation (and the layout never drifts)."""
    compute = jnp.dtype(cfg.model.compute_dtype)
    use_mtp = cfg.model.mtp and model_cfg.num_nextn_predict_layers > 0
    lam, alpha, gamma = cfg.loss.mtp_lambda, cfg.loss.balance_alpha, cfg.loss.bias_gamma
    remat = remat_policy(cfg.model.remat)

    def loss_fn(params, buffers, batch):
        tokens, seg = batch["tokens"], batch["segment_ids"]
        inputs, seg_in = tokens[:, :-1], seg[:, :-1]
        out = forward(params, buffers, inputs, model_cfg, segment_ids=seg_in, positions=batch["positions"],
                      dtype=compute, mtp=use_mtp and "mtp" in params, backend=cfg.model.backend, remat=remat,
                      mesh=mesh)  # fmt: skip
        with jax.named_scope("loss"):
            targets, mask = obj.targets_at(tokens, seg, 1)
            ce = obj.masked_cross_entropy(out.logits, targets, mask)
            mtp = jnp.zeros((), jnp.float32)
            if out.mtp_logits is not None:
                depths = out.mtp_logits.shape[0]
                for j in range(depths):
                    t, m = obj.targets_at(tokens, seg, 2 + j)
                    mtp = mtp + obj.masked_cross_entropy(out.mtp_logits[j], t, m) / depths
            balance = obj.balance_loss(out.routing, inputs.shape[0], model_cfg) if out.routing else jnp.zeros(())
            total = ce + lam * mtp + alpha * balance
        loads = obj.expert_loads(out.routing, model_cfg.n_routed_experts) if out.routing else jnp.zeros((0, 1))
        return total, dict(ce_loss=ce, mtp_loss=mtp, balance_loss=balance, loads=loads)

    def step(state, batch):
        params, buffers = state["params"], state["buffers"]
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "buffers": obj.update_router_bias(buffers, aux["loads"], gamma),
        }
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        old = {k: state[k] for k in new}
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # a bad step changes nothing
        new["step"] = state["step"] + 1
        metrics = dict(loss=loss, ce_loss=aux["ce_loss"], balance_loss=aux["balance_loss"], grad_norm=grad_norm,
                       lr=schedule(state["step"]), finite=finite, load_imbalance=obj.imbalance(aux["loads"]))  # fmt: skip
        if use_mtp:
            metrics["mtp_loss"] = aux["mtp_loss"]
        return new, metrics

    return jax.jit(step, donate_argnums=0, out_shardings=(state_shardings, None))


def commit(state: dict, mesh) -> dict:
    """Every leaf on its final device(s): placed leaves keep their sharding, others (the step
    counter; everything without a mesh) go to the first device or are replicated on the mesh."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    default = SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if getattr(x, "committed", False) else jax.device_put(x, default), state)


# ---- throughput --------------------------------------------------------------------------------
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0, "B300": 2250.0, "GB300": 2500.0}


def peak_tflops(configured: float | None) -> tuple[float, str]:
    """Per-device peak for MFU: configured, a dense BF16 datasheet figure for known GPUs, or (CPU)
    a float32 matmul measured here."""
    if configured:
        return configured, "configured"
    device = jax.devices()[0]
    for name, tflops in GPU_PEAK_TFLOPS.items():
        if name in device.device_kind:
            return tflops, f"{name} BF16 dense datasheet"
    n = 2048  # ~50 ms a matmul on 2 cores: long enough to time steadily
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times)) / 1e12, f"measured {n}x{n} float32 matmul on {device.platform}"


# ---- checkpoints --------------------------------------------------------------------------------
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


# ---- the run -----------------------------------------------------------------------------------
def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, log=print) -> dict:
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from moe_jax import data as data_mod
    from moe_jax.sharding import as_mesh, batch_sharding
    from moe_jax.train.metrics import MetricsWriter

    run = Path(cfg.run_dir).absolute()
    ckpt_dir = run / "checkpoints"
    lead = jax.process_index() == 0
    if not lead:
        log = lambda *a: None  # noqa: E731  (one process speaks)
    have = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    if have and not resume:
        raise ConfigError(f"{run}: has checkpoints (steps {have}); pass --resume to continue, or use another run_dir")
    inputs = [p for p in (cfg.model.init, cfg.data.tokenizer) if p and Path(p).exists()]
    refuse_overlap(run, inputs, flag="run_dir")  # the run's outputs never replace what it reads
    remat_policy(cfg.model.remat)  # fail early on a bad name
    mesh = as_mesh(cfg.mesh)
    if cfg.validate.required:
        require_validation(cfg, log)
    config, tree, source_dtypes, extra_files, source = starting_point(cfg, mesh)
    model_cfg = ModelConfig.from_hf_dict(config)

    tokenizer_dir = cfg.data.tokenizer or (extra_files[0].parent if extra_files else None)
    tokenizer = data_mod.load_tokenizer(tokenizer_dir, model_cfg.vocab_size)
    stream = data_mod.load_stream(cfg.data.source, tokenizer)
    dataset = data_mod.PackedDataset(stream, cfg.data.seq_len, tokenizer.eos_id)
    tx, schedule = make_optimizer(cfg)
    state = {"params": tree["params"], "buffers": tree["buffers"]}
    state["opt_state"] = jax.jit(tx.init)(state["params"])
    state["step"] = jnp.zeros((), jnp.int32)
    state = commit(state, mesh)

    if lead and ckpt_dir.is_dir():
        set_aside_unrecorded_checkpoints(ckpt_dir, log)
    sync_processes("train: checkpoints checked")
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=cfg.checkpoint.async_save)
    manager = ocp.CheckpointManager(ckpt_dir, options=options)
    start, skipped, bad_in_a_row = 0, 0, 0
    if resume and manager.latest_step() is not None:
        latest = manager.latest_step()
        step_dir = ckpt_dir / str(latest)
        try:
            verify_directory(step_dir)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (to resume from an earlier checkpoint, remove {step_dir})") from None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                   meta=ocp.args.JsonRestore()))  # fmt: skip
        state, meta = restored["state"], restored["meta"]
        start, skipped, bad_in_a_row = meta["data"]["step"], meta["skipped_steps"], meta["nonfinite_in_a_row"]
        log(f"resumed from {ckpt_dir / str(latest)} (step {start})")
    elif resume:
        log(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
    if start >= cfg.steps:
        log(f"nothing to do: at step {start} of {cfg.steps}")

    batches = data_mod.batches(dataset, cfg.data.batch_size, cfg.data.seed, jax.process_index(), jax.process_count(), start)
    step_fn = make_step(cfg, model_cfg, tx, schedule, mesh, jax.tree.map(lambda x: x.sharding, state))
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = obj.flops_per_token(model_cfg, cfg.data.seq_len, cfg.model.mtp) * tokens_per_step
    peak, peak_source = peak_tflops(cfg.peak_tflops)
    n_dev = jax.device_count()
    if lead:
        run.mkdir(parents=True, exist_ok=True)
        atomic_write(run / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    writer = MetricsWriter(run, tensorboard=cfg.tensorboard, resume_step=start) if lead else None
    log(f"training {source}: {sum(x.size for x in jax.tree.leaves(state['params'])) / 1e6:.2f}M params, "
        f"{len(dataset)} sequences of {cfg.data.seq_len} tokens, {n_dev} device(s), peak {peak:.3g} TFLOP/s "
        f"per device ({peak_source})")  # fmt: skip

    def place(batch: dict) -> dict:
        batch = {**batch, "positions": data_mod.positions_from_segments(batch["segment_ids"][:, :-1])}
        if mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, (cfg.data.batch_size,) + v.shape[1:]), v)
                for k, v in batch.items()}  # fmt: skip

    unrecorded: list[int] = []  # steps saved (perhaps still being written) without integrity records

    def record_saved(wait: bool) -> None:
        """Integrity records for the checkpoints whose (asynchronous) save has finished."""
        if wait:
            manager.wait_until_finished()  # every process: Orbax may synchronize them here
        elif not unrecorded or manager.is_saving_in_progress():
            return
        while unrecorded:
            step_dir = ckpt_dir / str(unrecorded.pop())
            if lead and step_dir.is_dir():  # (Orbax may already have deleted an old one)
                record_directory(step_dir)

    def save(step: int):
        meta = {"data": batches.state, "skipped_steps": skipped, "nonfinite_in_a_row": bad_in_a_row}  # data step == step
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        unrecorded.append(step)

    losses = {}
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not (progress and lead))
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            state, metrics = step_fn(state, place(next(batches)))  # batch `step`
            metrics = jax.device_get(metrics)
            dt = time.perf_counter() - t0
            finite = bool(metrics.pop("finite"))
            skipped += not finite
            bad_in_a_row = 0 if finite else bad_in_a_row + 1
            done = step + 1
            tflops = flops_per_step / dt / n_dev / 1e12
            record = {k: float(v) for k, v in metrics.items() if k != "load_imbalance"}
            record.update(load_imbalance=[float(x) for x in metrics["load_imbalance"]], tokens_per_s=tokens_per_step / dt,
                          step_time_s=dt, tflops_per_device=tflops, mfu=tflops / peak, skipped_steps=skipped)  # fmt: skip
            losses[done] = record["loss"]
            if writer and (done % cfg.log_every == 0 or done == cfg.steps):
                writer.write(done, record)
            if bad_in_a_row >= cfg.optim.max_nonfinite:
                raise TrainingError(f"step {done}: loss or gradient not finite for {bad_in_a_row} steps in a row "
                                    f"(optim.max_nonfinite); stopping. Lower optim.lr or check the data.")  # fmt: skip
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", step_s=f"{dt:.2f}")
            bar.update(1)
            if done % cfg.checkpoint.every == 0 or done == cfg.steps:
                record_saved(wait=True)  # Orbax waits for the previous save before starting one anyway
                save(done)
            record_saved(wait=False)
    finally:
        bar.close()
        record_saved(wait=True)
        manager.close()
        if writer:
            writer.close()

    from converters.jax_checkpoint import save_model

    model_dir = save_model(run / "model", config, {"params": state["params"], "buffers": state["buffers"]},
                           source=f"{source}, trained {cfg.steps} steps", source_dtypes=source_dtypes,
                           hf_files=extra_files, inputs=inputs)  # fmt: skip
    if cfg.export_dtype and lead:
        from converters.export import export_hf

        export_hf(model_dir, run / "hf", dtype=cfg.export_dtype, force=True, progress=False)
    return {"run": str(run), "model": str(model_dir), "losses": losses, "skipped_steps": skipped,
            "final_loss": losses.get(cfg.steps, math.nan)}  # fmt: skip
