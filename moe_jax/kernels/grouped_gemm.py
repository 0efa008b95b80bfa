"""The one grouped-GEMM interface that every MoE expert matmul goes through.

`grouped_matmul(x[M, K], w[G, K, N], group_sizes[G]) -> [M, N]`: rows of `x` are sorted by
group; rows `[start_g, start_g + group_sizes[g])` are multiplied by `w[g]`. Group sizes stay
on the device (no host sync, jit-safe); rows past `sum(group_sizes)` come back as zeros.
Differentiable in `x` and `w`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


BACKENDS = {"ragged_dot": _ragged_dot}


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: str = "ragged_dot") -> jax.Array:
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown grouped-GEMM backend {backend!r} (have: {', '.join(BACKENDS)})") from None
    return fn(x, w, group_sizes)
