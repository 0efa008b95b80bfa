"""PyTorch <-> JAX: build our model from a live `DeepseekV3ForCausalLM` (or its state dict)
and write our weights back into one.

torch -> numpy is a zero-copy view for every dtype (bf16 and float8 are viewed through an
integer type of the same width); the only copy is the one into the stacked parameter arrays.
JAX -> torch goes through DLPack (zero-copy) and is copied once, into the torch parameter.
transformers v5 keeps routed experts fused in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); both directions translate them to the per-expert on-disk
names, so the mapping table stays the single source of truth.
"""

from __future__ import annotations

import importlib
import re
from typing import Mapping

import ml_dtypes
import numpy as np
import torch

from converters.load import load_tree
from moe_jax.config import ModelConfig
from moe_jax.model import model_from_tree
from moe_jax.params import MOE_MLP, entries, get_path, has_mtp_tensors, layer_prefix

_VIEW_AS = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}

# The routed experts' on-disk names in a layer, from the table: parameter (gate, up, down) ->
# its name with "{e}" for the expert; transformers fuses them under the same scope ("mlp.experts.").
_EXPERT_HF = {rule.path.rsplit("/", 1)[-1]: rule.hf for rule in MOE_MLP if rule.per_expert}
_EXPERTS_SCOPE = _EXPERT_HF["gate"].split("{e}")[0]
# transformers v5's fused tensors of a layer's experts and the parameters each holds, in order
# along its rows: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I].
_FUSED_PARTS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_PART_OF = {part: fused for fused, parts in _FUSED_PARTS.items() for part in parts}
_MARK = 987654321
_ANY_LAYER = "(" + re.escape(layer_prefix(_MARK)).replace(str(_MARK), r"\d+") + ")"  # group 1: the layer prefix
_FUSED = re.compile(_ANY_LAYER + re.escape(_EXPERTS_SCOPE) + f"({'|'.join(_FUSED_PARTS)})$")


def _per_expert_pattern(template: str) -> re.Pattern:
    """Any layer's name of one routed expert's tensor (groups: layer prefix, expert)."""
    before, after = template.split("{e}")
    return re.compile(_ANY_LAYER + re.escape(before) + r"(\d+)" + re.escape(after) + "$")


_PER_EXPERT = {part: _per_expert_pattern(hf) for part, hf in _EXPERT_HF.items()}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy), ml_dtypes for bf16/float8."""
    t = t.detach()
    if t.dtype in _VIEW_AS:
        int_type, np_type = _VIEW_AS[t.dtype]
        return t.view(int_type).numpy().view(np_type)
    return t.numpy()


class StateDictSource:
    """A torch state dict seen under the on-disk HF tensor names (fused experts split)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            m = _FUSED.match(name)
            if not m:
                self.tensors[name] = t
                continue
            layer, fused = m.groups()
            parts = _FUSED_PARTS[fused]
            for e in range(t.shape[0]):
                for part, value in zip(parts, t[e].chunk(len(parts), dim=0)):
                    self.tensors[layer + _EXPERT_HF[part].format(e=e)] = value

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        return torch_to_numpy(self.tensors[name])


def torch_slot(state_dict: Mapping[str, torch.Tensor], hf_name: str) -> torch.Tensor | None:
    """The torch tensor (or view into a fused one) that holds on-disk tensor `hf_name`."""
    if hf_name in state_dict:
        return state_dict[hf_name]
    for part, pattern in _PER_EXPERT.items():
        if m := pattern.match(hf_name):
            break
    else:
        return None
    layer, e = m.group(1), int(m.group(2))
    fused = layer + _EXPERTS_SCOPE + _PART_OF[part]
    if fused not in state_dict:
        return None
    parts = _FUSED_PARTS[_PART_OF[part]]
    return state_dict[fused][e].chunk(len(parts), dim=0)[parts.index(part)]


def transformers_classes(cfg: ModelConfig):
    """transformers' (config class, model class) of this language model: DeepseekV3's, or
    DeepseekV32's for DeepSeek-V3.2."""
    import transformers

    name = cfg.architecture
    return getattr(transformers, name.removesuffix("ForCausalLM") + "Config"), getattr(transformers, name)


def transformers_modeling(cfg: ModelConfig):
    """transformers' modeling module of this language model (its decoder layer, rotary embedding)
    and the prefix of its class names ("DeepseekV3", "DeepseekV32")."""
    prefix = cfg.architecture.removesuffix("ForCausalLM")
    name = "deepseek_v32" if cfg.dsa else "deepseek_v3"
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}"), prefix


def config_of(torch_model) -> ModelConfig:
    return ModelConfig.from_hf_dict(torch_model.config.to_dict())


def from_torch(model_or_state_dict, config: ModelConfig | dict | None = None, dtype: str = "float32", **kwargs):
    """Our `DeepseekV3` from a live transformers model or a state dict (give `config` then).

    MTP layers load when the state dict holds them (transformers' model never does)."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        cfg = config_of(model_or_state_dict) if config is None else config
        state_dict = model_or_state_dict.state_dict()
    else:
        if config is None:
            raise ValueError("from_torch(state_dict) needs the model config")
        cfg, state_dict = config, model_or_state_dict
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_hf_dict(cfg)
    source = StateDictSource(state_dict)
    tree = load_tree(source, cfg, dtype, mtp=has_mtp_tensors(source.names(), cfg))
    return model_from_tree(cfg, tree, **kwargs)


@torch.no_grad()
def to_torch(model, torch_model: torch.nn.Module) -> torch.nn.Module:
    """Copy our weights into a transformers `DeepseekV3ForCausalLM` in place (DLPack views)."""
    state_dict = torch_model.state_dict()
    tree = {"params": model.params, "buffers": model.buffers}
    views: dict[tuple[str, ...], torch.Tensor] = {}
    for entry in entries(model.config, mtp=False):
        if entry.rule.tied_to:
            continue
        slot = torch_slot(state_dict, entry.hf_name)
        if slot is None:
            raise KeyError(f"torch model has no tensor for {entry.hf_name}")
        if entry.path not in views:
            views[entry.path] = torch.from_dlpack(get_path(tree, entry.path))
        src = views[entry.path][entry.index]
        slot.copy_(src.T if entry.rule.transpose else src)
    return torch_model
