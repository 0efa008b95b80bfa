from moe_jax.kernels.grouped_gemm import BACKENDS, default_backend, grouped_ffn, grouped_matmul, resolve_backend

__all__ = ["BACKENDS", "default_backend", "grouped_ffn", "grouped_matmul", "resolve_backend"]
