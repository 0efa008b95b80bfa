"""Grouped GEMMs on jax's own Pallas Mosaic GPU kernels: no row is multiplied by a weight not its own.

XLA lowers `jax.lax.ragged_dot` on GPUs as a dense dot over every group, masked: at 32 local
experts, 32x the useful FLOPs and an [M, G, K] temporary. These kernels walk the groups instead:
- Hopper (sm_90): `ragged_dot_mgpu` for the forward (x @ w_g) and the input gradient (dy @ w_g^T,
  its `transpose_rhs`); `transposed_ragged_dot_mgpu` for the weight gradient (x_g^T @ dy_g, ragged
  over the contracted rows).
- Blackwell (sm_100, sm_103): `blackwell_ragged_dot_mgpu` (tcgen05, 2-CTA clusters) for the forward and
  the input gradient (on w transposed: a copy of the weight). jax ships no Blackwell
  weight-gradient kernel: it runs as `tiled`'s windows, which waste no FLOPs but run one
  window after another.
The kernels take 16-bit operands, tile K and N in fixed blocks (`KERNEL_BLOCK` must divide
both), and Blackwell's tiles rows too (rows are padded to its tile with zeros, which belong to no
group). `supports` says whether an input fits; `moe_jax.kernels.grouped_gemm` (backend "mgpu")
falls back to XLA's `ragged_dot` where it does not, or where the GPU is neither. The kernels' imports are deferred to their use: they cost
every process 0.4 s and only a GPU (or a deviceless GPU compile, moe_jax.gpu) can run them.
"""

from __future__ import annotations

import jax.numpy as jnp

from moe_jax import gpu

KERNEL_BLOCK = 256  # K and N: 128-wide blocks, two per grid step (Hopper); 2 x 128 per cluster (Blackwell)
BLACKWELL_ROWS = 256  # rows per cluster tile on Blackwell (2 CTAs x 128)


def architecture() -> str | None:
    """The kernels' family for the GPU being compiled for (moe_jax.gpu.capability): "hopper",
    "blackwell", or None where they do not run."""
    cc = gpu.capability()
    # wgmma is sm_90's, tcgen05 data-center Blackwell's (sm_100, sm_103); consumer Blackwell
    # (sm_120) has neither
    return {9: "hopper", 10: "blackwell"}.get(cc[0]) if cc else None


_compiled_for: list[tuple[int, int]] = []  # the GPU architecture this process's kernels are built for


def claim_architecture() -> None:
    """jax's Mosaic GPU builds every kernel of a process for the first GPU architecture it built one
    for; a later one fails deep in ptxas ("SM version specified by .target is higher than default
    SM version assumed"). Say so plainly instead, before building a kernel for another."""
    cc = gpu.capability()
    if _compiled_for and cc != _compiled_for[0]:
        first, now = ("sm_%d%d" % c for c in (_compiled_for[0], cc))
        raise ValueError(
            f"this process built Mosaic GPU kernels for {first}; jax's Mosaic GPU cannot build them for {now} "
            f"in the same process: compile for each GPU architecture in a process of its own"
        )
    _compiled_for[:] = [cc]


def supports(x, w) -> bool:
    """Whether x [M, K] @ w [G, K, N] suits the kernels: a GPU they run on, 16-bit operands of one
    dtype (the tensor-core paths they are written for), K and N in whole blocks."""
    k, n = w.shape[1:]
    same_16bit = x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
    return architecture() is not None and same_16bit and k % KERNEL_BLOCK == 0 and n % KERNEL_BLOCK == 0


def hopper_ragged_dot(x, w, group_sizes, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    claim_architecture()
    return ragged_dot_mgpu.ragged_dot(
        x,
        w,
        group_sizes=group_sizes,
        block_m=128,
        block_n=128,
        block_k=64,
        max_concurrent_steps=4,
        grid_block_n=2,
        transpose_rhs=transpose_rhs,
    )


def hopper_weight_grad(x, dy, group_sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    claim_architecture()
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x, dy, group_sizes=group_sizes, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2
    )


def blackwell_ragged_dot(x, w, group_sizes):
    from jax.experimental.pallas.ops.gpu import blackwell_matmul_mgpu, blackwell_ragged_dot_mgpu

    claim_architecture()
    config = blackwell_ragged_dot_mgpu.TuningConfig(
        tile_m=128,
        tile_n=128,
        tile_k=64,
        max_concurrent_steps=4,
        collective=True,
        grid_tile_width=8,
        grid_minor_dim=blackwell_matmul_mgpu.MatmulDimension.N,
    )
    m = x.shape[0]
    padded = -(-m // BLACKWELL_ROWS) * BLACKWELL_ROWS
    x = jnp.pad(x, ((0, padded - m), (0, 0)))
    return blackwell_ragged_dot_mgpu.ragged_dot_kernel(x, w, group_sizes, config)[:m]
