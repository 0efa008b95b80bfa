"""The GPU a program is compiled for: the one in the machine, or a deviceless target.

XLA's GPU compiler runs on a machine without a GPU (`jax[cuda13]` at jax's own version, the
`gpu-compile` extra): `topology("h100", hosts=2, gpus_per_host=8)` describes a cluster of a
target kind, `deviceless_mesh` lays a mesh over it, and `jax.jit(f).lower(<ShapeDtypeStructs on
that mesh>).compile()` compiles for it, inside `compiling_for(devices)` (below). Nothing runs:
the compiled program's memory (`memory_analysis()`) and FLOPs (`flops`) are what it shows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge  # XLA's cost analysis and cuDNN's capability checks: jax internals
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
from jax._src.lib import _jax
from jax.experimental import topologies
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU kind, from its public datasheet (memory as the driver reports it where known).
    The rates are what `moe-jax plan`'s roofline estimate divides by: dense BF16 FLOP/s, one
    direction of NVLink per GPU inside an NVLink domain of `nvlink_domain` GPUs (an HGX board of
    8; a GB200/GB300 NVL72 rack of 72), and the network (InfiniBand/RoCE) per GPU between domains."""

    description: str
    capability: tuple[int, int]
    sms: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    peak_bf16_flops: float = 0.0  # dense, FLOP/s
    nvlink_bandwidth: float = 0.0  # bytes/s, one direction, per GPU
    nvlink_domain: int = 8  # GPUs that NVLink connects all-to-all
    network_bandwidth: float = 50e9  # bytes/s per GPU between NVLink domains (a 400 Gb/s NIC each)
    shared_memory_per_sm: int = 233_472  # 228 KiB on Hopper and Blackwell
    shared_memory_per_block_optin: int = 232_448
    peak_fp8_flops: float = 0.0  # dense FP8 (and MXFP8) FLOP/s; 0: FP8 matmuls counted at the BF16 peak


MIB = 2**20
# fmt: off
TARGETS = {
    "h100": Target("NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 81_559 * MIB, 3.35e12, 50 * MIB, 989e12, 450e9, peak_fp8_flops=1979e12),
    "h200": Target("NVIDIA H200", (9, 0), 132, 1.98, 143_771 * MIB, 4.8e12, 50 * MIB, 989e12, 450e9, peak_fp8_flops=1979e12),
    "b200": Target("NVIDIA B200", (10, 0), 148, 1.965, 183_359 * MIB, 8.0e12, 126 * MIB, 2250e12, 900e9, peak_fp8_flops=4500e12),
    "gb200": Target("NVIDIA GB200", (10, 0), 148, 1.965, 189_471 * MIB, 8.0e12, 126 * MIB, 2500e12, 900e9, 72, peak_fp8_flops=5000e12),
    "b300": Target("NVIDIA B300", (10, 3), 148, 1.965, 274_658 * MIB, 8.0e12, 126 * MIB, 2250e12, 900e9, peak_fp8_flops=4500e12),
    "gb300": Target("NVIDIA GB300", (10, 3), 160, 1.965, 284_208 * MIB, 8.0e12, 126 * MIB, 2500e12, 900e9, 72, 100e9, peak_fp8_flops=5000e12),
}
# fmt: on


def target_of(device_kind: str) -> Target | None:
    """The target whose name a device kind ("NVIDIA GB200", "NVIDIA H100 80GB HBM3") holds; the
    longest match, so that GB200 is not taken for B200."""
    names = [n for n in TARGETS if n.upper() in device_kind.upper()]
    return TARGETS[max(names, key=len)] if names else None


class GpuCompilerMissing(RuntimeError):
    """Deviceless GPU compilation was asked for where XLA's GPU compiler is not installed."""


def target_config(target: Target) -> str:
    """`target` as the GpuTargetConfigProto text that XLA's GPU compiler reads."""
    major, minor = target.capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {target.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {target.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(target.memory_bandwidth)}
  l2_cache_size: {target.l2_bytes}
  clock_rate_ghz: {target.clock_ghz}
  device_memory_size: {target.memory_bytes}
  shared_memory_per_block_optin: {target.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
runtime_version {{ major: 13 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{target.description}"
"""


def topology(name: str, hosts: int = 1, gpus_per_host: int = 1, target: Target | None = None):
    """A deviceless cluster of `hosts` x `gpus_per_host` GPUs of kind `name` (a key of TARGETS),
    or of `target`'s figures where given."""
    if target is None and name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(TARGETS)}")
    if hosts < 1 or gpus_per_host < 1:
        raise ValueError(f"a cluster needs at least one host and one GPU per host, got {hosts} x {gpus_per_host}")
    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=target_config(target or TARGETS[name]), topology=f"1x{hosts}x{gpus_per_host}"
        )
    except Exception as e:  # jax raises a bare RuntimeError/ValueError when no CUDA plugin is installed
        raise GpuCompilerMissing(
            f"compiling for {name} needs XLA's GPU compiler: pip install 'jax[cuda13]=={jax.__version__}' "
            f"(the moe-jax 'gpu-compile' extra) ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def deviceless_mesh(topo, shape: dict[str, int]) -> Mesh:
    """A mesh with axes `shape` (name -> size, product = the topology's device count) over `topo`."""
    return topologies.make_mesh(topo, tuple(shape.values()), tuple(shape))


def capability(devices=None) -> tuple[int, int] | None:
    """The CUDA compute capability of the GPU being compiled for: the deviceless target inside
    `compiling_for`, else the first local device; None when that is not an NVIDIA GPU."""
    device = (devices or _compiling_for or jax.local_devices())[0]
    value = str(getattr(device, "compute_capability", ""))  # "9.0" on CUDA; "gfx942" on ROCm
    major, _, minor = value.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


_compiling_for: list = []


@contextlib.contextmanager
def compiling_for(devices):
    """While tracing and compiling for deviceless `devices`, answer from them what GPU kernels ask
    the live device: the Pallas Mosaic GPU grouped GEMMs read the SM count from
    `jax.devices()[0]`, and jax's cuDNN attention checks the default backend's compute capability.
    Without a GPU both would see the CPU. On a machine with a GPU this changes nothing."""
    devices = list(np.ravel(devices))
    if jax.default_backend() == "gpu":
        yield
        return
    cc = capability(devices)

    def at_least(wanted: str) -> bool:
        return cc >= tuple(int(p) for p in wanted.split("."))

    def equal(wanted: str) -> bool:
        return cc == tuple(int(p) for p in wanted.split("."))

    answers = [
        (jax, "devices", lambda *a, **k: devices),
        (jax, "local_devices", lambda *a, **k: devices),
        (cudnn_attention, "check_compute_capability", at_least),
        (cudnn_attention, "is_cuda_compute_capability_equal", equal),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in answers]
    try:
        for owner, name, value in answers:
            setattr(owner, name, value)
        _compiling_for[:] = devices
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _compiling_for.clear()


def flops(compiled) -> float:
    """XLA's FLOP count of a compiled program (custom calls, e.g. Pallas kernels, count 0)."""
    module = compiled._executable.xla_extension_executable().hlo_modules()[0]
    return float(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module).get("flops", 0.0))


ARRAY = re.compile(r"\b(?:pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def describe(compiled) -> dict:
    """What a compiled GPU program holds: XLA's FLOPs (custom calls count 0), its temporary
    memory, its largest array (elements and shape) and its custom calls by target."""
    text = compiled.as_text()
    shapes = {m.group(0) for m in ARRAY.finditer(text)}
    largest = max(shapes, key=lambda s: math.prod(int(d) for d in ARRAY.match(s).group(1).split(",") if d))
    return {
        "flops": flops(compiled),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "largest_array": largest,
        "largest_elements": math.prod(int(d) for d in ARRAY.match(largest).group(1).split(",") if d),
        "custom_calls": dict(collections.Counter(CUSTOM_CALL.findall(text))),
    }


def abstract(topo, shape, dtype) -> jax.ShapeDtypeStruct:
    """An array of `shape` and `dtype` on the first GPU of `topo` (for `compile_and_describe`)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(topo.devices[0]))


def compile_and_describe(topo, f, *args) -> dict:
    """`describe` of `f` compiled for `topo`'s GPUs at the abstract `args`."""
    with compiling_for(topo.devices):
        return describe(jax.jit(f).lower(*args).compile())


def forward_backward(f, argnums):
    """The sum of f's outputs and its gradient with respect to `argnums`: a program holding f's
    forward and backward pass, to compile and describe."""

    def total(*args):
        return sum(jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(f(*args)))

    return jax.value_and_grad(total, argnums)
