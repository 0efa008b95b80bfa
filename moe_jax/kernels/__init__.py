from moe_jax.kernels.grouped_gemm import BACKENDS, grouped_matmul

__all__ = ["BACKENDS", "grouped_matmul"]
