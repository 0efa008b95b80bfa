"""`moe-jax` command line. Bad input: one line on stderr naming the file/tensor, exit 2.

Each command imports what it runs when it runs (jax, torch and the converters take seconds to
import), so `moe-jax --help` and argument errors answer at once."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from moe_jax.errors import CheckpointError, ConfigError, one_line

EXIT_FAIL = 1  # ran, but the check failed
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def _integer(text: str, low: int, high: int | None = None) -> int:
    """argparse type: an integer in [low, high) (argparse's error names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, 2**{high.bit_length() - 1})"
        raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1)


def seed(text: str) -> int:
    return _integer(text, 0, 2**63)


def size_in_bytes(text: str) -> int:
    """argparse type: a positive size such as 5GB or 500MB, in bytes."""
    from converters.export import parse_size

    try:
        size = parse_size(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 5GB or 500MB, got {text!r}")
    return size


def output_file(text: str) -> str:
    """argparse type: a file the command writes when its work is done, checked before the work
    starts: not a directory, in an existing directory the user can write in."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {parent}")
    return text


class Parser(argparse.ArgumentParser):
    """Argument errors in one line, like every other bad input (--help shows the usage)."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _cmd_make_tiny(args) -> int:
    from converters.tiny import make_tiny

    out = make_tiny(
        args.out,
        args.variant,
        fp8_weights=args.fp8,
        dtype=args.dtype,
        shards=args.shards,
        seed=args.seed,
        force=args.force,
        int4_experts=args.int4,
        wrapper=args.wrapper,
    )
    formats = [args.variant] + ["fp8"] * args.fp8 + ["int4 experts"] * args.int4 + [args.wrapper] * bool(args.wrapper)
    family = {"v32": "DeepSeek-V3.2", "kimi-k2": "Kimi-K2"}.get(args.variant, "DeepSeek-V3")
    print(f"wrote tiny {family} checkpoint ({', '.join(formats)}) to {out}")
    return 0


def _cmd_convert(args) -> int:
    from converters.convert import convert_hf

    t0 = time.perf_counter()
    manifest = convert_hf(
        args.src, args.to, dtype=args.dtype, mtp=not args.no_mtp, force=args.force, workers=args.workers
    )
    n = len(manifest["tensors"])
    print(
        f"converted {n} tensors from {args.src} to {args.to} ({manifest['dtype']}, "
        f"MTP {'yes' if manifest['mtp'] else 'no'}) in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def _cmd_export(args) -> int:
    from converters.export import export_hf

    t0 = time.perf_counter()
    out = export_hf(
        args.src,
        args.to,
        dtype=args.dtype,
        shard_size=args.shard_size,
        force=args.force,
        workers=args.workers,
    )
    print(f"exported {args.src} to {out} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_validate(args) -> int:
    from converters.hub import resolve_source
    from moe_jax.config import ModelConfig
    from moe_jax.files import refuse_write_into, write_json
    from validation.layerwise import plot, prompt_tokens, random_tokens, validate
    from validation.parity import format_report

    src = resolve_source(args.hf)
    for flag, out in (("--report", args.report), ("--plot", args.plot)):
        if out:
            refuse_write_into(out, [p for p in (src, args.jax, args.prompts) if p], flag)
    if args.report and args.plot and os.path.realpath(args.report) == os.path.realpath(args.plot):
        raise ConfigError(f"--report and --plot name one file ({args.report}): give each its own")
    model_cfg = ModelConfig.from_json(src)
    if args.tokens > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"--tokens {args.tokens}: more than the model's max_position_embeddings "
            f"({model_cfg.max_position_embeddings}, {src / 'config.json'})"
        )
    if args.prompts:
        from moe_jax.data import ByteTokenizer, load_tokenizer

        tokenizer = load_tokenizer(src, model_cfg.vocab_size)
        if isinstance(tokenizer, ByteTokenizer):  # (training's fallback: no tokenizer in the checkpoint)
            raise FileNotFoundError(
                f"{src}: --prompts needs the checkpoint's tokenizer (tokenizer.json, or tiktoken.model and "
                "tokenizer_config.json)"
            )
        tokens = prompt_tokens(tokenizer, Path(args.prompts), args.tokens)
    else:
        tokens = random_tokens(model_cfg.vocab_size, args.batch, args.tokens, args.seed)
    report = validate(src, tokens, args.jax, args.dtype, "reference" if args.layerwise else "own")
    print(format_report(report))
    if args.report:
        write_json(args.report, report, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0 if report["pass"] else EXIT_FAIL


def _cmd_quickstart(args) -> int:
    from moe_jax.quickstart import quickstart

    return 0 if quickstart(args.workdir, args.steps) else EXIT_FAIL


def _cmd_train(args) -> int:
    from contextlib import nullcontext

    import jax

    from moe_jax import distributed
    from moe_jax.train import stderr_relay
    from moe_jax.train.config import load_config
    from moe_jax.train.loop import TrainingError, train
    from moe_jax.train.metrics.plots import summary
    from moe_jax.train.preemption import PeerWatch, StopSignal
    from moe_jax.train.xla import apply_preset

    cfg = load_config(args.config, args.overrides)
    apply_preset(cfg.xla_preset, cfg.xla_flags)  # before anything starts the backend
    # jax's own heartbeat aborts with a stack trace: let the loop's peer watch speak first
    heartbeat = 2 * cfg.peer_timeout_s + 30
    try:
        with StopSignal() as stop:  # from here on SIGTERM or Ctrl-C stops the run at a step boundary, saved
            multi = distributed.initialize(
                args.coordinator,
                args.num_processes,
                args.process_id,
                heartbeat_timeout_s=heartbeat,
                join_timeout_s=cfg.join_timeout_s,
            )
            if multi:  # jax's abort when process 0 is killed becomes one line (moe_jax.train.stderr_relay)
                stderr_relay.start(jax.process_index(), jax.process_count())
            # watched from here: a process lost while loading or compiling stops the others too
            with PeerWatch(cfg.peer_timeout_s) if multi else nullcontext():
                result = train(cfg, resume=args.resume, progress=not args.quiet, stop=stop)
    except TrainingError as e:
        print(f"moe-jax train: {e}", file=sys.stderr)
        return EXIT_FAIL
    if jax.process_index() == 0 and result["preempted_at"] is None:  # (a preempted run said where it stopped)
        print(summary(result["run"]))
        print(f"model: {result['model']}")
    return 0


def _cmd_plan(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless: no GPU backend needed, or wanted
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's compiler notes (the plan reports what matters)
    import json

    from moe_jax.files import atomic_write, refuse_write_into
    from moe_jax.train.config import load_config
    from moe_jax.train.plan import Cluster, describe_plan, plan, target_from_file
    from moe_jax.train.xla import apply_preset

    if args.json:
        refuse_write_into(args.json, [p for p in (args.config, args.spec) if p], "--json")
    cfg = load_config(args.config, args.overrides)
    apply_preset(cfg.xla_preset, cfg.xla_flags)  # the flags the run would compile with (the schedule's overlap)
    spec = target_from_file(args.spec) if args.spec else None
    cluster = Cluster(args.target, args.hosts, args.gpus_per_host, spec)
    result = plan(cfg, cluster, log=lambda msg: print(msg, file=sys.stderr))
    print(describe_plan(result))
    if args.json:
        atomic_write(args.json, json.dumps(result, indent=1) + "\n")
    return 0


def _cmd_verify(args) -> int:
    from converters.verify import verify

    print(verify(args.path))
    return 0


def _cmd_plot(args) -> int:
    from moe_jax.files import refuse_write_into
    from moe_jax.train.metrics.plots import plot, summary
    from moe_jax.train.metrics.store import metrics_path

    if args.out:
        refuse_write_into(args.out, [metrics_path(args.run), Path(args.run) / "checkpoints"], "--out")
    out = plot(args.run, args.out)
    print(summary(args.run))
    print(f"wrote {out}")
    return 0


def add_run_config(p: argparse.ArgumentParser) -> None:
    """A training run's config: a YAML file and section.key=value overrides (train, plan)."""
    p.add_argument("--config", help="YAML file (see configs/); keys not given take their defaults")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.lr=1e-3 mesh=data=2,expert=4")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moe-jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    q = sub.add_parser(
        "quickstart", help="tiny checkpoint -> JAX parity -> convert -> validate -> train -> export -> transformers"
    )
    q.add_argument("--workdir", default="runs/quickstart")
    q.add_argument("--steps", type=positive_int, default=40, help="training steps")
    q.set_defaults(fn=_cmd_quickstart)

    t = sub.add_parser(
        "make-tiny", help="write a tiny random DeepSeek-V3 (or V3.2) checkpoint in the HF/DeepSeek format"
    )
    t.add_argument("out")
    t.add_argument(
        "--variant",
        default="base",
        choices=["base", "flat", "wide", "v32", "kimi-k2"],
        help="DeepSeek-V3 configs (base, flat, wide), DeepSeek-V3.2's (v32: sparse attention), "
        "or Kimi-K2's (kimi_k2 config.json, tiktoken tokenizer)",
    )
    t.add_argument("--fp8", action="store_true", help="store projections as DeepSeek FP8 (e4m3 + 128x128 scales)")
    t.add_argument(
        "--int4", action="store_true", help="store routed experts as compressed-tensors INT4 (as Kimi-K2-Thinking)"
    )
    t.add_argument(
        "--wrapper", choices=["kimi_k25"], help="inside Kimi-K2.5's multimodal wrapper (with a vision tower)"
    )
    t.add_argument("--dtype", choices=["float32", "bfloat16"], help="storage of non-FP8 tensors")
    t.add_argument("--shards", type=int, default=1)
    t.add_argument("--seed", type=seed, default=0)
    t.add_argument("--force", action="store_true", help="replace a previous checkpoint in OUT")
    t.set_defaults(fn=_cmd_make_tiny)

    c = sub.add_parser("convert", help="HF safetensors checkpoint (FP8/BF16/FP32) -> moe-jax JAX checkpoint")
    c.add_argument("--from", dest="fmt", choices=["hf"], required=True, help="source format")
    c.add_argument("src", help="HF checkpoint directory or hub repo id (the local cache works offline)")
    c.add_argument("--to", required=True, help="output directory")
    c.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    c.add_argument("--no-mtp", action="store_true", help="leave the MTP layers out")
    c.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    c.add_argument("--workers", type=positive_int, default=4, help="reader/writer threads")
    c.set_defaults(fn=_cmd_convert)

    e = sub.add_parser("export", help="moe-jax JAX checkpoint -> HF safetensors shards")
    e.add_argument("--from", dest="src", required=True, help="moe-jax checkpoint directory")
    e.add_argument("--to", required=True, help="output directory")
    e.add_argument(
        "--dtype",
        default="source",
        choices=["source", "bfloat16", "float32", "fp8"],
        help="source: every tensor as it came in (FP8 stays FP8); fp8: DeepSeek's FP8 layout",
    )
    e.add_argument("--shard-size", type=size_in_bytes, default="5GB")
    e.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    e.add_argument("--workers", type=positive_int, default=4)
    e.set_defaults(fn=_cmd_export)

    v = sub.add_parser(
        "validate", help="compare the JAX model with transformers' DeepseekV3ForCausalLM, layer by layer"
    )
    v.add_argument("--hf", required=True, help="HF checkpoint directory (the reference)")
    v.add_argument("--jax", help="converted checkpoint to check (default: the JAX model loaded from --hf)")
    v.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="of both sides (default: the dtype the JAX checkpoint holds; for an HF directory alone, what convert would give)",
    )
    v.add_argument(
        "--prompts",
        help="text file, one prompt a line, tokenized with the checkpoint's tokenizer (tokenizer.json or tiktoken.model)",
    )
    v.add_argument(
        "--tokens",
        type=positive_int,
        default=64,
        help="sequence length (random tokens), or the cap for prompts; at most the model's max_position_embeddings",
    )
    v.add_argument("--batch", type=positive_int, default=2, help="random sequences")
    v.add_argument("--seed", type=seed, default=0)
    v.add_argument("--layerwise", action="store_true", help="feed both sides the reference's hidden state")
    v.add_argument("--report", type=output_file, help="write the JSON report here")
    v.add_argument("--plot", type=output_file, help="write a PNG of the error per layer here")
    v.set_defaults(fn=_cmd_validate)

    tr = sub.add_parser("train", help="continued pretraining (or from scratch) in JAX, from a YAML config")
    add_run_config(tr)
    tr.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    multi = tr.add_argument_group("multi-process (else JAX_COORDINATOR_ADDRESS etc., or SLURM/MPI detection)")
    multi.add_argument("--coordinator", help="host:port of process 0's coordinator service")
    multi.add_argument("--num-processes", type=int, help="number of processes in the run")
    multi.add_argument("--process-id", type=int, help="this process's id, 0 .. num-processes-1")
    tr.set_defaults(fn=_cmd_train)

    pn = sub.add_parser(
        "plan",
        help="compile a training config's step for a GPU cluster without the cluster: memory, FLOPs, "
        "collectives and an estimated step time per device",
    )
    add_run_config(pn)
    pn.add_argument("--target", default="h100", help="h100 | h200 | b200 | gb200 | b300 | gb300 | cpu (this machine)")
    pn.add_argument("--hosts", type=positive_int, default=1, help="nodes in the cluster")
    pn.add_argument("--gpus-per-host", type=positive_int, default=8, help="GPUs a node (a GB200/GB300 tray: 4)")
    pn.add_argument(
        "--spec", help="a JSON file of the GPU's figures (moe_jax.gpu.Target fields) instead of a known target"
    )
    pn.add_argument("--json", type=output_file, help="also write the plan here as JSON")
    pn.set_defaults(fn=_cmd_plan)

    vf = sub.add_parser(
        "verify",
        help="check a checkpoint's integrity: a moe-jax checkpoint (every file against "
        "its checksum) or an HF directory (headers, index, names, dtypes, shapes, FP8 scales)",
    )
    vf.add_argument("path", help="moe-jax checkpoint, HF checkpoint directory or hub repo id")
    vf.set_defaults(fn=_cmd_verify)

    pl = sub.add_parser("plot", help="draw a training run's loss and load-balance curves to PNG")
    pl.add_argument("run", help="the run directory (with metrics.jsonl)")
    pl.add_argument("--out", type=output_file, help="PNG path (default: RUN/metrics.png)")
    pl.set_defaults(fn=_cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # train's key=value overrides may come after its flags
        if args.cmd not in ("train", "plan") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    code = run_command(args)
    if code and in_multiprocess_run():
        # the other processes may be gone: jax's exit-time barrier would wait for them, then abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_command(args) -> int:
    """The command's exit status; an error is one line on stderr."""
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"moe-jax {args.cmd}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: what the command was writing is already removed
        print(f"\nmoe-jax {args.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001  (anything else from a library: still one line, not a traceback)
        if os.environ.get("MOE_JAX_TRACEBACK"):
            raise
        print(
            f"moe-jax {args.cmd}: error: {type(e).__name__}: {one_line(e)} (set MOE_JAX_TRACEBACK=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT


def in_multiprocess_run() -> bool:
    """Has this process joined a multi-process jax run?"""
    distributed = sys.modules.get("jax._src.distributed")
    return distributed is not None and distributed.global_state.client is not None


if __name__ == "__main__":
    sys.exit(main())
