"""The reference FP8 KV-cache attention (x86 CPUs without AVX-512 or AMX) against plain attention.

Pure torch, no engine: the codes it stores are the FP8 casts of value/scale at
each token's slot, and its attention equals `scaled_dot_product_attention`
over the dequantized keys and values, per request, through a shuffled block
table, with grouped query heads, causal offsets and a sliding window. The
engines of the rest of the suite run through it on such machines.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from refit.engine.cpu_kv_cache import attend_fp8, fp8_format, store_fp8

BLOCK, KV_HEADS, HEADS, HEAD_SIZE = 32, 2, 4, 64


def fp8_round_trip(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    return (x.float() / scale).to(fmt).float() * scale


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_tokens_are_stored_as_fp8_codes_at_their_slots_and_padding_is_skipped(kv_cache_dtype):
    fmt = fp8_format(kv_cache_dtype)
    cache = torch.zeros(4, KV_HEADS, BLOCK, HEAD_SIZE, dtype=torch.uint8)
    x = torch.randn(3, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    store_fp8(x, cache, torch.tensor([70, -1, 5]), 0.5, fmt)
    expected = (x.float() / 0.5).to(fmt).view(torch.uint8)
    assert torch.equal(cache[2, :, 70 - 64], expected[0]) and torch.equal(cache[0, :, 5], expected[2])
    assert int(cache.count_nonzero()) == int(expected[0].count_nonzero() + expected[2].count_nonzero())


def test_values_beyond_the_format_saturate_instead_of_becoming_nan():
    cache = torch.zeros(1, KV_HEADS, BLOCK, HEAD_SIZE, dtype=torch.uint8)
    store_fp8(torch.full((1, KV_HEADS, HEAD_SIZE), 1e6), cache, torch.tensor([0]), 1.0, torch.float8_e4m3fn)
    assert torch.all(cache[0, :, 0].view(torch.float8_e4m3fn).float() == 448.0)


def test_an_unknown_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        fp8_format("int8")


@pytest.mark.parametrize("sliding_window", [-1, 9])
def test_attention_equals_sdpa_over_the_dequantized_cache(sliding_window):
    torch.manual_seed(0)
    fmt, k_scale, v_scale, scale = torch.float8_e4m3fn, 0.3, 0.7, HEAD_SIZE**-0.5
    # Two prefills of one length (attended together) after unequal cached contexts, and two decode steps.
    lengths, queries = [47, 70, 33, 20], [7, 1, 1, 7]
    key_cache = torch.zeros(9, KV_HEADS, BLOCK, HEAD_SIZE, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.tensor([[5, 2, 7], [0, 6, 3], [4, 1, 0], [8, 0, 0]])  # short rows padded with block 0
    keys = [torch.randn(n, KV_HEADS, HEAD_SIZE) for n in lengths]
    values = [torch.randn(n, KV_HEADS, HEAD_SIZE) for n in lengths]
    for request, n in enumerate(lengths):
        positions = torch.arange(n)
        slots = block_table[request, positions // BLOCK] * BLOCK + positions % BLOCK
        store_fp8(keys[request], key_cache, slots, k_scale, fmt)
        store_fp8(values[request], value_cache, slots, v_scale, fmt)
    query = torch.randn(sum(queries), HEADS, HEAD_SIZE)
    output = torch.empty_like(query)
    attend_fp8(query, key_cache, value_cache, output, query_start_loc=torch.tensor([0, 7, 8, 9, 16]),
               seq_lens=torch.tensor(lengths), block_table=block_table, scale=scale, k_scale=k_scale,
               v_scale=v_scale, fmt=fmt, sliding_window=sliding_window)

    first = 0
    for request, (n, q) in enumerate(zip(lengths, queries)):
        k = fp8_round_trip(keys[request], k_scale, fmt).repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = fp8_round_trip(values[request], v_scale, fmt).repeat_interleave(HEADS // KV_HEADS, dim=1)
        query_pos, key_pos = torch.arange(n - q, n)[:, None], torch.arange(n)[None, :]
        mask = key_pos <= query_pos
        if sliding_window > 0:
            mask &= key_pos > query_pos - sliding_window
        expected = F.scaled_dot_product_attention(query[first:first + q].transpose(0, 1), k.transpose(0, 1),
                                                  v.transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(output[first:first + q], expected, atol=1e-5, rtol=1e-5)
        first += q


@pytest.mark.parametrize("k_scale", [-0.000942, 0.0, float("nan")])
def test_a_placeholder_scale_is_refused_as_vllms_fp8_kernels_refuse_it(k_scale):
    """A dummy load's negative scale fails generation here as on AVX-512 machines: the seed bug reproduces."""
    cache = torch.zeros(1, KV_HEADS, BLOCK, HEAD_SIZE, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="k_scale must be positive for FP8 path"):
        store_fp8(torch.ones(1, KV_HEADS, HEAD_SIZE), cache, torch.tensor([0]), k_scale, torch.float8_e4m3fn)
