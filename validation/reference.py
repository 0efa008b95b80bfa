"""The PyTorch reference: transformers' DeepseekV3ForCausalLM (DeepseekV32ForCausalLM for
DeepSeek-V3.2) on an HF checkpoint.

transformers cannot load DeepSeek's FP8 checkpoints on a CPU, so for those the reference is
built from the config and given the block-dequantized weights (DeepSeek's semantics, computed
here in torch, independently of the JAX loader's `converters.fp8.dequantize`). INT4
(compressed-tensors) weights are decompressed by the compressed-tensors library itself, and
other model types (kimi_k2) and wrappers (kimi_k25) get a DeepseekV3Config of their language
model's fields; their own remote code is never run.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from converters import fp8, int4
from converters.load import check_no_scale, read_scale
from converters.safetensors_io import CheckpointReader
from converters.torch_interop import torch_slot, transformers_classes
from moe_jax.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()  # it lists our MTP tensors as "unexpected"
    transformers.utils.logging.disable_progress_bar()


def hf_config(path: str | Path):
    """transformers' DeepseekV3Config (DeepseekV32Config for DeepSeek-V3.2) for a checkpoint's
    language model (a wrapper's text config), from its fields alone: never the checkpoint's own
    (remote) code, no quantization. Eager attention: the one whose masks DeepSeek-V3.2's sparse
    attention takes."""
    cfg = ModelConfig.from_json(path)
    config = transformers_classes(cfg)[0](**cfg.transformers_fields())
    config._attn_implementation = "eager"
    return config


def to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy (ml_dtypes bfloat16 included) -> torch, same values."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


@functools.cache
def int4_scheme(config_json: Path):
    """The compressed-tensors QuantizationScheme of a checkpoint's (one) config group."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(ModelConfig.from_json(config_json).text_config["quantization_config"])
    return next(iter(qc.config_groups.values()))


def decompress_int4(reader: CheckpointReader, name: str) -> np.ndarray:
    """A packed INT4 weight as float32, unpacked and scaled by the compressed-tensors library."""
    from compressed_tensors.compressors import BaseCompressor

    parts = {"weight" + s: to_torch(reader.get(name + s)) for s in int4.SUFFIXES}
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    out = compressor.decompress(parts, int4_scheme(reader.root / "config.json"))
    return out["weight"].float().numpy()


def dequantize(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """DeepSeek's weight_dequant in torch: every e4m3 value [out, in] times the float32 scale of
    its 128x128 block (partial edge blocks included)."""
    values = torch.tensor(q.view(np.uint8)).view(torch.float8_e4m3fn).to(torch.float32)
    rows, cols = values.shape
    scales = torch.tensor(scale, dtype=torch.float32).repeat_interleave(fp8.BLOCK, 0).repeat_interleave(fp8.BLOCK, 1)
    return values * scales[:rows, :cols]


def load_reference_tensor(reader: CheckpointReader, name: str) -> np.ndarray:
    """A tensor as float32, FP8 blocks dequantized in torch, INT4 by compressed-tensors."""
    if reader.dtypes.get(name) == int4.DTYPE:
        return decompress_int4(reader, name)
    arr = reader.get(name)
    if arr.dtype == fp8.FP8_DTYPE:
        return dequantize(arr, read_scale(reader, name, arr.shape)).numpy()
    check_no_scale(reader, name, arr.dtype)
    return np.asarray(arr, np.float32)


@torch.no_grad()
def load_reference(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """transformers' model of the checkpoint at `path` (DeepseekV3ForCausalLM, or
    DeepseekV32ForCausalLM for DeepSeek-V3.2), in `dtype`, eager attention."""
    quiet_transformers()
    path = Path(path)
    model_class = transformers_classes(ModelConfig.from_json(path))[1]
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") in ("deepseek_v3", "deepseek_v32") and not raw.get("quantization_config"):
        return model_class.from_pretrained(path, dtype=TORCH_DTYPES[dtype], attn_implementation="eager").eval()
    # FP8 and INT4 (which transformers cannot load on a CPU), other model types and wrappers:
    # the model from the config's fields, given the weights read here
    model = model_class._from_config(hf_config(path), dtype=TORCH_DTYPES[dtype]).eval()
    reader = CheckpointReader(path, ModelConfig.from_json(path).tensor_prefix)
    state = model.state_dict()
    for name in reader.names():
        slot = torch_slot(state, name)
        if slot is None:  # scales, MTP layers: not part of the transformers model
            continue
        slot.copy_(torch.from_numpy(load_reference_tensor(reader, name)))
    return model
