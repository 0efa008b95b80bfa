"""Parity of the JAX model against the PyTorch reference (transformers)."""
