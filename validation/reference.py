"""The PyTorch reference: transformers' DeepseekV3ForCausalLM on an HF checkpoint.

transformers cannot load DeepSeek's FP8 checkpoints on a CPU, so for those the reference is
built from the config and given the block-dequantized weights (DeepSeek's semantics, computed
here in torch, independently of the JAX loader's `converters.fp8.dequantize`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from converters import fp8
from converters.load import check_no_scale, read_scale
from converters.safetensors_io import CheckpointReader
from converters.torch_interop import torch_slot

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()  # it lists our MTP tensors as "unexpected"
    transformers.utils.logging.disable_progress_bar()


def hf_config(path: str | Path):
    """transformers' DeepseekV3Config for a checkpoint (its quantization_config left out)."""
    from transformers import DeepseekV3Config

    raw = json.loads((Path(path) / "config.json").read_text())
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "quantization_config", "architectures")}
    return DeepseekV3Config(**fields)


def dequantize(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """DeepSeek's weight_dequant in torch: every e4m3 value [out, in] times the float32 scale of
    its 128x128 block (partial edge blocks included)."""
    values = torch.tensor(q.view(np.uint8)).view(torch.float8_e4m3fn).to(torch.float32)
    rows, cols = values.shape
    scales = torch.tensor(scale, dtype=torch.float32).repeat_interleave(fp8.BLOCK, 0).repeat_interleave(fp8.BLOCK, 1)
    return values * scales[:rows, :cols]


def load_reference_tensor(reader: CheckpointReader, name: str) -> np.ndarray:
    """A tensor as float32, FP8 blocks dequantized in torch."""
    arr = reader.get(name)
    if arr.dtype == fp8.FP8_DTYPE:
        return dequantize(arr, read_scale(reader, name, arr.shape)).numpy()
    check_no_scale(reader, name, arr.dtype)
    return np.asarray(arr, np.float32)


@torch.no_grad()
def load_reference(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    from transformers import DeepseekV3ForCausalLM

    quiet_transformers()
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if not raw.get("quantization_config"):
        return DeepseekV3ForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype]).eval()
    model = DeepseekV3ForCausalLM._from_config(hf_config(path), dtype=TORCH_DTYPES[dtype]).eval()
    reader = CheckpointReader(path)
    state = model.state_dict()
    for name in reader.names():
        slot = torch_slot(state, name)
        if slot is None:  # scales, MTP layers: not part of the transformers model
            continue
        slot.copy_(torch.from_numpy(load_reference_tensor(reader, name)))
    return model
