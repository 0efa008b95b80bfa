"""Tiny checkpoints built once per session, in the real on-disk formats; the order tests run in."""

import hashlib
import os
import resource
import shutil
import tempfile

# One XLA compilation cache for the whole run, subprocesses included (they inherit the
# environment): the tiny model's train step and forward are compiled once, not in every test.
# The process that made it (pytest itself; xdist's workers inherit it) removes it at the end.
OWN_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="moe-jax-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", OWN_CACHE or "")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# XLA:CPU compiles faster, unless the environment says otherwise (the suite's budget is mostly
# compiling): LLVM at -O0 rather than -O2, and fusions by XLA's classic elemental emitters rather than
# its newer MLIR fusion emitters. Both are XLA's own code generators for the same HLO: every numerical
# check sees the program users run, optimised alike up to machine code (XLA:CPU uses no fast-math
# either way). The tiny model's train step: 25 s of CPU to compile and run 12 steps, against 35 s with
# -O0 alone and 48 s with XLA's defaults; its steps run 2.3x slower than at -O2.
SUITE_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
for flag, value in SUITE_XLA_FLAGS.items():
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{flag}={value}".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from converters.convert import convert_hf  # noqa: E402
from converters.tiny import make_tiny  # noqa: E402

# name -> make_tiny arguments. Together: grouped routing on/off, q_lora_rank set/null, YaRN on/off,
# interleaved and plain rope, MTP present/absent, FP32/BF16/FP8 storage, widths that are not
# multiples of 128, single-file and sharded layouts.
FIXTURES = {
    "base_sharded": dict(variant="base", shards=3),
    "flat_single": dict(variant="flat"),
    "wide_fp8_sharded": dict(variant="wide", fp8_weights=True, shards=2),
    "base_fp8_single": dict(variant="base", fp8_weights=True),
    "base_bf16_single": dict(variant="base", dtype="bfloat16"),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny(root / name, **kw) for name, kw in FIXTURES.items()}


@pytest.fixture(params=sorted(FIXTURES))
def checkpoint(request, checkpoints):
    return checkpoints[request.param]


def tree_digest(path) -> dict[str, str]:
    """Every file below `path` -> the sha256 of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """converted(name): that fixture converted to a JAX checkpoint (`convert_hf`, default flags), once
    per session. Shared, so read only: a test that changes one works on a copy (the session fails
    at its end if a shared one changed)."""
    root = tmp_path_factory.mktemp("converted")
    made: dict[str, tuple] = {}

    def get(name):
        if name not in made:
            convert_hf(checkpoints[name], root / name, progress=False)
            made[name] = (root / name, tree_digest(root / name))
        return made[name][0]

    yield get
    changed = [str(path) for path, digest in made.values() if tree_digest(path) != digest]
    assert not changed, f"a test changed the shared converted checkpoint(s) {changed}"


def random_tokens(vocab, batch=2, length=24, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


# The slowest tests (CPU seconds in a whole run of the suite), first, in this order: each xdist
# worker takes the next test when it has at most two left (`pytest_xdist_make_scheduler` below), so
# the workers end together instead of one waiting for the other's last long test. A test not named
# keeps its place, after these; a module named runs whole, in its own order. The training tests
# share one compiled step (configs/tiny.yaml's shapes; lr, steps and loss weights are inputs of it),
# so the one that compiles it runs well before the others, which then load it from the cache.
# The scheduler hands the first and third tests to one worker and the second and fourth to the
# other: the other worker's two use no such step.
SLOW_FIRST = [
    "tests/test_train.py::test_bias_update_balances_a_skewed_router",  # 48 s; compiles the shared step
    "tests/test_multiprocess.py::test_two_processes_equal_one",  # 68 s; its own 2-process step first
    "tests/test_train.py::test_loss_falls_below_what_a_context_free_model_can_reach",  # 88 s
    "tests/test_ep.py::test_model_on_meshes_equals_single_device",  # 52 s
    "tests/test_gpu_compile.py",  # 115 s
    "tests/test_launch.py",  # 146 s; its tests one after another (a module-scoped reference run), 2 processes each
    "tests/test_plan.py::test_plan_of_the_tiny_model_for_two_h100_nodes",  # 40 s
    "tests/test_cli.py::test_quickstart_runs_the_whole_pipeline",  # 50 s
    "tests/test_train.py::test_sigkill_and_resume_gives_the_same_losses",  # 46 s
    "tests/test_te_compile.py",  # 38 s
    "tests/test_bench_ep.py::test_bench_ep_quick",  # 33 s
    "tests/test_plan.py::test_cpu_plan_is_within_a_quarter_of_the_memory_the_step_uses",  # 31 s
    "tests/test_ep.py::test_expert_parallel_equals_single_device",  # 23 s
    "tests/test_bench_moe.py::test_bench_moe_small",  # 22 s
    "tests/test_convert.py::test_sigkill_at_any_point_then_rerun_gives_identical_output",  # 20 s
    "tests/test_dsa.py::test_v32_checkpoint_converts_validates_trains_in_both_stages_and_exports",  # 41 s
    "tests/test_family.py::test_convert_validate_train_export_reload",  # 17 + 7 + 8 s; the Kimi tiny's step
    "tests/test_first_hour.py::test_a_training_run_is_quiet_and_readable_by_others",  # 17 s
    "tests/test_model.py::test_remat_policies_give_the_same_gradients",  # 16 s
    "tests/test_train.py::test_next_step_is_dispatched_before_a_step_is_read",  # 16 s
    "tests/test_integrity.py::test_resume_checks_the_step_checkpoint_and_sets_aside_unrecorded_ones",  # 15 s
    "tests/test_readme.py::test_readme_example_runs",  # 14 s
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def place(item):
        test, module = item.nodeid.split("[")[0], item.nodeid.split("::")[0]
        return rank.get(test, rank.get(module, len(rank)))

    items.sort(key=place)  # stable: the rest keep their order


# Modules whose tests share a module-scoped fixture (a compile per GPU target, a minute each; the
# launch tests' reference run): all on one worker, or each worker would build it.
ONE_WORKER = {"tests/test_gpu_compile.py", "tests/test_te_compile.py", "tests/test_launch.py"}


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the suite also runs without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with a test as its own scope, except ONE_WORKER's modules. (xdist's
    own `--dist loadgroup` does not group under pytest 9: it renames items through an attribute
    pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in ONE_WORKER else nodeid

    return Scheduling(config, log)


def cpu_seconds() -> float:
    """User + system CPU of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With MOE_JAX_TEST_CPU_LOG=<file>: each test's CPU seconds (setup, call, teardown; its
    subprocesses included), appended as `seconds<TAB>test id` lines. The suite's budget is CPU
    time on 2 cores, and wall times on a busy machine say little about it."""
    log = os.environ.get("MOE_JAX_TEST_CPU_LOG")
    before = cpu_seconds()
    yield
    if log:
        with open(log, "a") as f:
            f.write(f"{cpu_seconds() - before:.1f}\t{item.nodeid}\n")


def pytest_sessionfinish(session):
    if OWN_CACHE:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)
