"""moe-jax: DeepSeek-V3-family mixture-of-experts models from PyTorch into JAX and back.

The public API, by name -> the module that defines it. Names resolve on first use (PEP 562), so
that `import moe_jax` and the `moe-jax` command line start without importing jax.
"""

import importlib
import os

from moe_jax.errors import CheckpointError, ConfigError, IntegrityError

# jax's CUDA plugin, installed where there is no NVIDIA driver (for deviceless GPU compilation,
# moe_jax.gpu), prints a traceback at start-up from its CUDA library version checks. Without a
# driver those checks say nothing useful: skip them (jax then uses the CPU, silently, as before).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

PUBLIC = {
    "ModelConfig": "moe_jax.config",
    "DeepseekV3": "moe_jax.model",
    "Output": "moe_jax.model",
    "forward": "moe_jax.model",
    "from_pretrained": "moe_jax.pretrained",
    "objective": "moe_jax.train.step",
    "make_train_step": "moe_jax.train.step",
    "init_train_state": "moe_jax.train.step",
    "make_batch": "moe_jax.train.step",
    "WarmupCosine": "moe_jax.train.step",
}

__all__ = ["CheckpointError", "ConfigError", "IntegrityError", *PUBLIC]


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
