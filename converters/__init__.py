"""Hugging Face safetensors <-> JAX parameters, and torch <-> JAX interop."""
