"""The batched SDPA prefill attention against the reference (float32 within 1e-5): whole prompts of
several lengths padded together, chunks after a cached prefix, sliding windows, GQA ratios 1/2/4,
scrambled block tables with holes, 8-bit caches; and the registry probing and timing it."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xinserve.kernels import kv_quant, registry
from xinserve.kernels.cpu import sdpa_prefill
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import scrambled_block_tables
from xinserve.kernels.references import dense as ref

BLOCK_SIZE, D = 16, 32


def paged_inputs(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, seed: int,
                 cache_dtype: torch.dtype = torch.float32):
    """Random caches over a scrambled pool twice the size the sequences need (so their tables have holes
    between their blocks), block tables, and the step's queries."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, D)
    key_cache, value_cache = (kv_quant.quantize(torch.randn(shape, generator=generator), cache_dtype)
                              for _ in range(2))
    tables = torch.from_numpy(scrambled_block_tables(seq_lens, BLOCK_SIZE, num_blocks, seed))
    query = torch.randn(sum(q_lens), num_heads, D, generator=generator)
    start_loc = np.concatenate(([0], np.cumsum(q_lens))).tolist()
    return query, key_cache, value_cache, tables, start_loc


def assert_matches_reference(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                             seed: int = 0, window: int | None = None,
                             cache_dtype: torch.dtype = torch.float32) -> None:
    query, key_cache, value_cache, tables, start_loc = paged_inputs(q_lens, seq_lens, num_heads, num_kv_heads, seed,
                                                                    cache_dtype)
    keywords = {} if window is None else {"sliding_window": window}
    scale = D**-0.5
    got = sdpa_prefill.paged_prefill_attention(query, key_cache, value_cache, tables, start_loc, seq_lens, scale,
                                                **keywords)
    want = ref.paged_prefill_attention(query, key_cache, value_cache, tables, start_loc, seq_lens, scale, **keywords)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_whole_prompts_of_several_lengths_equal_the_reference(num_heads: int, num_kv_heads: int) -> None:
    # 40/37/33 pad together, 16 and 1 do not (PAD_SLACK): one padded call and single ones
    assert_matches_reference([40, 16, 37, 1, 33], [40, 16, 37, 1, 33], num_heads, num_kv_heads)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_chunks_after_a_cached_prefix_equal_the_reference(num_heads: int, num_kv_heads: int) -> None:
    # a whole prompt, a chunk after a prefix ending mid-block, one after a block-aligned prefix,
    # a one-token chunk (a drafted decode's shape) and a chunk crossing several blocks
    assert_matches_reference([21, 7, 16, 1, 40], [21, 30, 48, 9, 77], num_heads, num_kv_heads, seed=1)


@pytest.mark.parametrize("window", [1, 8, 20, 100])
def test_sliding_windows_equal_the_reference(window: int) -> None:
    assert_matches_reference([21, 7, 40], [21, 30, 77], 4, 2, seed=2, window=window)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_caches_in_another_dtype_equal_the_reference(cache_dtype: torch.dtype) -> None:
    assert_matches_reference([24, 9, 22], [24, 41, 22], 4, 2, seed=3, cache_dtype=cache_dtype)


def test_prompts_of_equal_length_run_as_one_padded_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(sdpa_prefill, "F", SimpleNamespace(scaled_dot_product_attention=counting))
    assert_matches_reference([32, 32, 30, 32], [32, 32, 30, 32], 4, 2, seed=4)
    assert calls == [(4 * 2, 2, 32, D)]  # [rows * KVH, G, longest, D]: 4D, the fused kernel's layout


def test_the_registry_probes_and_times_it_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(registry.TIMING_ENV_VAR, "on")
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))  # a fresh timing cache
    shapes = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=D, rotary_dim=D, rope_is_neox=True, hidden_size=128,
                         intermediate_size=256, vocab_size=64, block_size=BLOCK_SIZE)
    selection = registry.select(("sdpa", "reference"), torch.device("cpu"), torch.float32, shapes)
    assert set(selection.timings_ms["prefill_attention"]) >= {"sdpa", "reference"}
    assert "sdpa" not in dict(selection.rejected.get("prefill_attention", []))
