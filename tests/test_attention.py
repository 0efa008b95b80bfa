"""Blockwise (flash) attention against the S x S reference: outputs and gradients, packed
segments across block boundaries, ragged lengths, MLA's Dqk != Dv; and memory linear in S."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import gpu
from moe_jax.kernels import attention as attention_module
from moe_jax.kernels.attention import attention, blockwise_attention, naive_attention

HEADS, DQK, DV = 3, 24, 16
SCALE = DQK**-0.5


def packed_segments(lengths_per_row: list[list[int]]) -> np.ndarray:
    """[B, S] segment ids: row r holds documents of lengths_per_row[r], back to back."""
    return np.array([np.repeat(np.arange(len(row)), row) for row in lengths_per_row], np.int32)


def inputs(segments: np.ndarray, dtype, seed: int = 0):
    b, s = segments.shape
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.normal(size=(b, s, HEADS, DQK)), dtype) for _ in range(2))
    v, d_out = (jnp.asarray(rng.normal(size=(b, s, HEADS, DV)), dtype) for _ in range(2))
    return q, k, v, jnp.asarray(segments), d_out


def output_and_grads(fn, q, k, v, segments, d_out):
    """fn's output and its gradients wrt q, k, v for the cotangent d_out, in one jitted call."""

    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, segments, SCALE), q, k, v)
        return (out, *pullback(d_out))

    return [np.asarray(x, np.float32) for x in jax.jit(run)(q, k, v)]


# (segment lengths per batch row, block_q, block_k); blocks of 8 and 16 rows
CASES = {
    # S = 37: no multiple of either block; documents end inside blocks, and differently per row
    "ragged_packed": ([[5, 14, 18], [20, 3, 13, 1]], 8, 16),
    # S = 64: exact blocks, one document per row and a document boundary on a block boundary
    "whole_blocks": ([[64], [16, 48]], 16, 16),
    # S = 6: shorter than one block
    "shorter_than_a_block": ([[6], [2, 4]], 8, 16),
}


@pytest.mark.parametrize("case", CASES)
def test_blockwise_matches_naive_float32(case):
    lengths, block_q, block_k = CASES[case]
    args = inputs(packed_segments(lengths), jnp.float32)
    blockwise = lambda *a: blockwise_attention(*a, block_q=block_q, block_k=block_k)  # noqa: E731
    # measured max abs errors: output 4.8e-7, gradients 1.4e-6, on values up to 3.9: float32 rounding
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), output_and_grads(blockwise, *args), output_and_grads(naive_attention, *args)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6, err_msg=name)


def test_blockwise_matches_naive_bfloat16():
    """In bfloat16 both differ from the float32 truth by rounding; blockwise (float32 logits and
    accumulators) no more than the reference does. Query blocks wider than key blocks, S = 37."""
    args = inputs(packed_segments([[5, 14, 18], [1, 30, 6]]), jnp.bfloat16)
    truth = output_and_grads(naive_attention, *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args))
    naive = output_and_grads(naive_attention, *args)
    blockwise = output_and_grads(lambda *a: blockwise_attention(*a, block_q=16, block_k=8), *args)
    for name, got, ref, want in zip(("out", "dq", "dk", "dv"), blockwise, naive, truth):
        # measured max errors over the largest value: blockwise 0.25-0.28%, the bfloat16 reference
        # 0.27-0.44% (blockwise/reference 0.64-0.96), blockwise vs the reference 0.34-0.65%
        assert np.abs(got - want).max() <= 1.25 * np.abs(ref - want).max(), name
        np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(want).max(), rtol=0, err_msg=name)


def test_dispatch():
    q, k, v, segments, _ = inputs(packed_segments([[4, 5]]), jnp.float32)
    blockwise = blockwise_attention(q, k, v, segments, SCALE)
    np.testing.assert_array_equal(np.asarray(attention(q, k, v, segments, SCALE)), np.asarray(blockwise))
    naive = attention(q, k, v, segments, SCALE, impl="naive")
    np.testing.assert_array_equal(np.asarray(naive), np.asarray(naive_attention(q, k, v, segments, SCALE)))
    with pytest.raises(ValueError, match="naive, blockwise, cudnn"):
        attention(q, k, v, segments, SCALE, impl="flash")


def compiled_gradient(fn, s: int, heads: int, dqk: int = 16, dv: int = 8):
    """fn's jitted forward + backward (gradients wrt q, k, v), compiled for batch 1."""
    q = k = jax.ShapeDtypeStruct((1, s, heads, dqk), jnp.float32)
    v = jax.ShapeDtypeStruct((1, s, heads, dv), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, s), jnp.int32)
    loss = lambda q, k, v, seg: fn(q, k, v, seg, SCALE).sum()  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, segments).compile()


def test_blockwise_memory_is_linear_in_sequence_length():
    s, heads = 2048, 2
    score_matrix = s * s * 4 * heads  # one float32 [B=1, N, S, S] array: 32 MiB
    naive = compiled_gradient(naive_attention, s, heads)
    blockwise = compiled_gradient(lambda *a: blockwise_attention(*a, block_q=256, block_k=256), s, heads)
    # measured scratch memory: naive 3.0 score matrices, blockwise 0.076 (its [256, 256] blocks)
    assert naive.memory_analysis().temp_size_in_bytes > score_matrix
    assert blockwise.memory_analysis().temp_size_in_bytes < score_matrix / 8
    assert f"{s},{s}]" in naive.as_text() and f"{s},{s}]" not in blockwise.as_text()


def test_a_document_is_a_run_of_equal_ids():
    """An id that comes back later in a row starts another document (cuDNN's packed layout can
    only express runs; every implementation agrees on it)."""
    ids = jnp.asarray([[0, 0, 1, 1, 0, 0, 2], [5, 5, 5, 5, 5, 5, 5]], jnp.int32)
    np.testing.assert_array_equal(attention_module.document_ids(ids), [[0, 0, 1, 1, 2, 2, 3], [0] * 7])
    q, k, v, _, _ = inputs(np.asarray(ids), jnp.float32)
    as_runs = naive_attention(q, k, v, attention_module.document_ids(ids), SCALE)
    np.testing.assert_array_equal(np.asarray(attention(q, k, v, ids, SCALE, impl="naive")), np.asarray(as_runs))


def test_cudnn_packed_layout_against_a_loop():
    """The lengths and offsets cuDNN's packed layout takes, against a row-by-row loop: -1 past each
    row's last document; `fits` is false once a row has more documents than the layout holds."""
    rows = [[3, 1, 4], [8], [1, 1, 1, 1, 1, 1, 1, 1]]
    ids = packed_segments(rows)
    for m in (8, 4):
        lengths, offsets, fits = attention_module.packed_segments(jnp.asarray(ids), m)
        for r, docs in enumerate(rows):
            want_lengths = (docs + [-1] * m)[:m]
            want_offsets = (list(np.cumsum([0, *docs[:-1]])) + [-1] * (m + 1))[: m + 1]
            if len(docs) <= m:
                assert list(np.asarray(lengths[r])) == want_lengths and list(np.asarray(offsets[r])) == want_offsets
        assert bool(fits) == (max(map(len, rows)) <= m)


def test_default_implementation_follows_the_target():
    """blockwise on this CPU; cuDNN when compiling for a Hopper or Blackwell GPU with 16-bit inputs
    (tests/test_gpu_compile.py compiles it), blockwise for float32 there."""
    q16, q32 = jnp.zeros((1, 8, 2, 192), jnp.bfloat16), jnp.zeros((1, 8, 2, 192), jnp.float32)
    v16, v32 = jnp.zeros((1, 8, 2, 128), jnp.bfloat16), jnp.zeros((1, 8, 2, 128), jnp.float32)
    assert attention_module.default_impl(q16, v16) == "blockwise"
    with gpu.compiling_for(gpu.topology("h100").devices):
        assert attention_module.default_impl(q16, v16) == "cudnn"
        assert attention_module.default_impl(q32, v32) == "blockwise"
