"""The MTP module against a PyTorch composition of transformers' own DeepSeek-V3 layers."""

import numpy as np
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

import moe_jax
from converters.load import read_float
from converters.safetensors_io import CheckpointReader
from converters.torch_interop import torch_slot
from tests.conftest import random_tokens
from validation.reference import load_reference


class TorchMTP(torch.nn.Module):
    """h' = eh_proj([enorm(embed(t[i+1])), hnorm(h[i])]) -> decoder layer -> shared head."""

    def __init__(self, config, layer_idx):
        super().__init__()
        hidden = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx)
        self.head_norm = DeepseekV3RMSNorm(hidden, config.rms_norm_eps)
        self.head = torch.nn.Linear(hidden, config.vocab_size, bias=False)


@torch.no_grad()
def test_mtp_logits_match_torch_composition(checkpoints):
    path = checkpoints["base_sharded"]
    ref = load_reference(path)
    cfg = ref.config
    layer_idx = cfg.num_hidden_layers
    mtp = TorchMTP(cfg, layer_idx).eval()
    # load the MTP tensors from the checkpoint by their on-disk names
    reader = CheckpointReader(path)
    prefix = f"model.layers.{layer_idx}."
    renames = {"shared_head.norm.weight": "head_norm.weight", "shared_head.head.weight": "head.weight"}
    layer_state = {f"model.layers.{layer_idx}." + k: v for k, v in mtp.layer.state_dict().items()}
    loaded = 0
    for name in reader.names():
        if not name.startswith(prefix):
            continue
        short = name[len(prefix) :]
        value = torch.from_numpy(np.asarray(read_float(reader, name), np.float32))
        if short == "embed_tokens.weight":
            torch.testing.assert_close(value, ref.model.embed_tokens.weight, rtol=0, atol=0)
            continue
        slot = torch_slot(layer_state, name)
        if slot is None:
            slot = mtp.state_dict()[renames.get(short, short)]
        slot.copy_(value)
        loaded += 1
    assert loaded > 20

    tokens = random_tokens(cfg.vocab_size, batch=2, length=16)
    t = torch.as_tensor(tokens, dtype=torch.long)
    captured = {}
    ref.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    ref(t)
    h = captured["h"]  # main model's last layer output, before the final norm
    shifted = torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)
    x = mtp.eh_proj(torch.cat([mtp.enorm(ref.model.embed_tokens(shifted)), mtp.hnorm(h)], dim=-1))
    pos = torch.arange(t.shape[1])[None].expand(t.shape[0], -1)
    s = t.shape[1]
    mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    out = mtp.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=ref.model.rotary_emb(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    expected = mtp.head(mtp.head_norm(out)).numpy()

    model = moe_jax.from_pretrained(path)
    got = np.asarray(model.apply(tokens, mtp=True).mtp_logits)
    assert got.shape == (1, *expected.shape)
    np.testing.assert_allclose(got[0], expected, atol=1e-4, rtol=0)
    # and the MTP layer really contributes: its logits differ from the main head's
    assert np.abs(got[0] - np.asarray(model(tokens))).mean() > 0.1
