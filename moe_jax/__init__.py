"""moe-jax: DeepSeek-V3-family mixture-of-experts models from PyTorch into JAX and back."""

from moe_jax.config import ModelConfig
from moe_jax.errors import CheckpointError, ConfigError, IntegrityError
from moe_jax.model import DeepseekV3, Output, forward

__all__ = ["CheckpointError", "ConfigError", "DeepseekV3", "IntegrityError", "ModelConfig", "Output", "forward",
           "from_pretrained"]  # fmt: skip


def __getattr__(name):
    # Loading pulls in the converters, which import moe_jax.config: resolve it lazily.
    if name == "from_pretrained":
        from moe_jax.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(name)
