"""FP8 block format against independent numpy loops over the 128x128 blocks."""

import json

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

import moe_jax
from converters import fp8
from moe_jax.params import entries, get_path


def loop_dequantize(q, scale, block=128):
    """DeepSeek's weight_dequant, written as the plain loop over blocks."""
    out = np.empty(q.shape, np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].astype(np.float32) * scale[i, j]
    return out


def read_all(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_fp8_checkpoint_loads_to_block_dequantized_weights(checkpoints):
    path = checkpoints["wide_fp8_sharded"]
    raw = read_all(path)
    model = moe_jax.from_pretrained(path)
    tree = {"params": model.params, "buffers": model.buffers}
    n_fp8 = 0
    for e in entries(model.config):
        stored = raw[e.hf_name]
        if stored.dtype == ml_dtypes.float8_e4m3fn:
            scale = raw[e.hf_name + "_scale_inv"]
            assert scale.dtype == np.float32
            assert scale.shape == (-(-stored.shape[0] // 128), -(-stored.shape[1] // 128))
            expected = loop_dequantize(stored, scale)
            n_fp8 += 1
        else:
            expected = stored.astype(np.float32)
        if e.rule.tied_to:
            continue
        got = np.asarray(get_path(tree, e.path))[e.index]
        np.testing.assert_array_equal(got, expected.T if e.rule.transpose else expected, err_msg=e.hf_name)
    assert n_fp8 > 20
    # partial edge blocks really occur (200 = 128 + 72 columns; 96 rows of kv_a)
    assert raw["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)
    # FP8 exactly where DeepSeek has it: projections yes; embeddings, norms, head, router, eh_proj no
    assert raw["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert raw["lm_head.weight"].dtype == ml_dtypes.bfloat16
    assert raw["model.layers.1.mlp.gate.weight"].dtype == ml_dtypes.bfloat16
    assert raw["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert raw["model.layers.2.eh_proj.weight"].dtype == ml_dtypes.bfloat16
    assert raw["model.layers.2.mlp.experts.3.down_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_quantize_matches_numpy_loop():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 200)) * rng.uniform(0.01, 3, (300, 1))).astype(np.float32)
    w[:128, :128] = 0  # an all-zero block must not divide by zero
    q, scale = fp8.quantize(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = np.float32(np.abs(blk).max() / np.float32(448.0))
            assert scale[i, j] == s
            ref = (blk / (s if s > 0 else np.float32(1))).astype(ml_dtypes.float8_e4m3fn)
            got = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    deq, finite = fp8.dequantize(q, scale)
    assert finite
    np.testing.assert_array_equal(deq, loop_dequantize(q, scale))
    # the round trip is within e4m3's relative precision of each block's amax
    err = np.abs(deq - w)
    assert err.max() <= np.abs(w).max() * 2**-3


def test_table_dequantization_equals_the_fused_pass_and_the_loop():
    """`dequantize` (a table lookup) gives the fused XLA pass's bits (which are the numpy loop's
    values cast to the target dtype), for partial edge blocks, transposed or not, bf16 and f32,
    tiny and huge scales; NaN codes are reported, overflowing scales fall back to XLA."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (300, 260)).astype(np.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # no NaN codes here
    q = codes.view(ml_dtypes.float8_e4m3fn)
    scale = np.exp(rng.uniform(-40, 40, fp8.scale_shape(q.shape))).astype(np.float32)
    scale[0, 0] = 1e-40  # a denormal scale: XLA flushes, the table must too
    want_f32 = loop_dequantize(q, scale)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        for transpose in (False, True):
            got, finite = fp8.dequantize(q, scale, transpose, dtype)
            ref, ref_finite = (np.asarray(a) for a in fp8._dequantize_xla(q, scale, transpose, np.dtype(dtype)))
            assert got.dtype == np.dtype(dtype) and got.shape == ref.shape and finite == ref_finite
            np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
            loop = (want_f32.T if transpose else want_f32).astype(dtype)
            np.testing.assert_array_equal(got[128:, 128:], loop[128:, 128:])  # away from the denormal block
    nan_q = codes.copy()
    nan_q[5, 7] = 0xFF
    assert fp8.dequantize(nan_q.view(ml_dtypes.float8_e4m3fn), scale, False, np.float32)[1] is False
    huge = np.full_like(scale, 3e38)  # 448 * 3e38 overflows: the fused pass decides
    got, finite = fp8.dequantize(q, huge, False, np.float32)
    assert not finite
