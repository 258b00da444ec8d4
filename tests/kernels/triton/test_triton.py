"""The Triton kernels against the pure-torch references, on CPU tensors under Triton's interpreter."""

import os
from dataclasses import replace

# Before kernels.triton is imported: @triton.jit reads it when the kernels are decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch

import xinserve.kernels.triton as triton_ops
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.probes.inputs import scrambled_block_tables
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import decode_attention

FP32 = {"atol": 2e-5, "rtol": 2e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}
# (head dim, KV heads, query heads, block size): odd head dims, GQA 3:1 and 1:1, blocks of 16 and 128
SHAPES = {
    "d8-gqa3-bs16": (8, 2, 6, 16),
    "d96-mha-bs128": (96, 2, 2, 128),
    "d96-gqa3-bs16": (96, 1, 3, 16),
    "d8-mha-bs128": (8, 2, 2, 128),
}
Shape = tuple[int, int, int, int]


def paged_cache(num_blocks: int, shape: Shape, dtype: torch.dtype = torch.float32):
    """Random key and value caches [N, BS, KVH, D]: every slot, used or not, holds a value."""
    head_dim, kv_heads, _, block_size = shape
    size = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(size).to(dtype), torch.randn(size).to(dtype)


def scrambled_tables(seq_lens: list[int], block_size: int) -> tuple[np.ndarray, int]:
    """[S, B] int32 block tables over a shuffled pool (rows padded with 0), and the pool size."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    return scrambled_block_tables(seq_lens, block_size, num_blocks, seed=0), num_blocks


def run_decode(seq_lens: list[int], shape: Shape, dtype: torch.dtype, **kwargs):
    """(Triton, reference) decode outputs over the same random cache."""
    head_dim, _, heads, block_size = shape
    tables_np, num_blocks = scrambled_tables(seq_lens, block_size)
    key_cache, value_cache = paged_cache(num_blocks, shape, dtype)
    query = torch.randn(len(seq_lens), heads, head_dim).to(dtype)
    lens_np = np.array(seq_lens, np.int32)
    tables, lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    args = (query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    gather = build_decode_gather(tables_np, lens_np, block_size, torch.device("cpu"))
    return triton_ops.paged_decode_attention(*args, **kwargs), reference.paged_decode_attention(*args, gather)


def run_prefill(q_lens: list[int], seq_lens: list[int], shape: Shape, dtype: torch.dtype):
    """(Triton, reference) prefill outputs; sequence i's q_lens[i] queries end its seq_lens[i] context."""
    head_dim, _, heads, block_size = shape
    tables_np, num_blocks = scrambled_tables(seq_lens, block_size)
    key_cache, value_cache = paged_cache(num_blocks, shape, dtype)
    query = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    query_start_loc = np.concatenate(([0], np.cumsum(q_lens))).tolist()
    tables = torch.from_numpy(tables_np)
    args = (query, key_cache, value_cache, tables, query_start_loc, seq_lens, head_dim**-0.5)
    return triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)


@pytest.mark.parametrize("shape", [SHAPES["d8-gqa3-bs16"], (96, 3, 3, 128)], ids=["d8-bs16", "d96-bs128"])
def test_write_kv_places_tokens_like_the_reference(shape: Shape) -> None:
    torch.manual_seed(0)
    head_dim, kv_heads, _, block_size = shape
    slots = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 5, 2 * block_size + 1])
    # keys and values as the model makes them: slices of one fused projection, so not contiguous
    kv = torch.randn(len(slots), 2, kv_heads, head_dim)
    got = paged_cache(4, shape)
    want = tuple(cache.clone() for cache in got)
    triton_ops.write_kv(kv[:, 0], kv[:, 1], *got, slots)
    reference.write_kv(kv[:, 0], kv[:, 1], *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_write_kv_into_a_bf16_layer_view_and_nothing_for_no_tokens() -> None:
    torch.manual_seed(1)
    kv_cache = torch.zeros(2, 3, 6, 16, 2, 8, dtype=torch.bfloat16)  # [2, layers, N, BS, KVH, D]
    key, value = torch.randn(3, 2, 8, dtype=torch.bfloat16), torch.randn(3, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([17, 0, 95])
    triton_ops.write_kv(key, value, kv_cache[0, 1], kv_cache[1, 1], slots)
    want = torch.zeros_like(kv_cache)
    reference.write_kv(key, value, want[0, 1], want[1, 1], slots)
    assert torch.equal(kv_cache, want)
    triton_ops.write_kv(key[:0], value[:0], kv_cache[0, 1], kv_cache[1, 1], slots[:0])
    assert torch.equal(kv_cache, want)


def test_write_kv_casts_to_the_cache_dtype() -> None:
    # fp16, not bf16: the interpreter truncates fp32 -> bf16 where GPUs (and torch) round to nearest
    torch.manual_seed(2)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([17, 0, 40])
    got = paged_cache(3, SHAPES["d8-gqa3-bs16"], torch.float16)
    want = tuple(cache.clone() for cache in got)
    triton_ops.write_kv(key, value, *got, slots)
    reference.write_kv(key, value, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_decode_matches_reference_over_block_boundaries(shape: Shape) -> None:
    torch.manual_seed(3)
    got, want = run_decode([1, 17, 130, 300], shape, torch.float32)
    torch.testing.assert_close(got, want, **FP32)


def test_decode_split_k_combines_partials_like_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    combines = []
    real = decode_attention._combine_splits_kernel

    class Spy:  # records each launch of the combine kernel, then launches it
        def __getitem__(self, grid: tuple[int, ...]):
            combines.append(grid)
            return real[grid]

    monkeypatch.setattr(decode_attention, "_combine_splits_kernel", Spy())
    # split_len 16: 19 splits over the 300-token context (one for the 1-token one); 4096: one split
    for split_len, launched in ((16, 1), (4096, 0)):
        torch.manual_seed(4)
        got, want = run_decode([1, 40, 130, 300], SHAPES["d8-gqa3-bs16"], torch.float32, split_len=split_len)
        torch.testing.assert_close(got, want, **FP32)
        assert len(combines) == launched
        combines.clear()


def test_decode_default_splits_fill_the_device_only_for_few_sequences() -> None:
    assert decode_attention.default_num_splits(8192, 1, 8) == decode_attention.MAX_SPLITS
    assert decode_attention.default_num_splits(8192, 64, 8) == 1
    assert decode_attention.default_num_splits(40, 1, 1) == 1  # one tile: nothing to split


def test_decode_bf16_within_bf16_tolerance() -> None:
    torch.manual_seed(5)
    got, want = run_decode([5, 17, 200], SHAPES["d96-gqa3-bs16"], torch.bfloat16, split_len=64)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16)


def test_decode_without_sequences_returns_empty() -> None:
    key_cache, value_cache = paged_cache(2, SHAPES["d8-gqa3-bs16"])
    tables, lens = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    out = triton_ops.paged_decode_attention(torch.randn(0, 6, 8), key_cache, value_cache, tables, lens, 0.3)
    assert out.shape == (0, 6, 8)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_prefill_mixed_batch_with_cached_prefix(shape: Shape) -> None:
    torch.manual_seed(6)
    # a whole prompt crossing blocks; a chunk after a 17-token prefix; one token after 299 (a decode)
    got, want = run_prefill([130, 40, 1], [130, 57, 300], shape, torch.float32)
    torch.testing.assert_close(got, want, **FP32)


def test_prefill_bf16_chunk_within_bf16_tolerance() -> None:
    torch.manual_seed(7)
    got, want = run_prefill([70, 3], [70, 150], SHAPES["d96-gqa3-bs16"], torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16)


def test_prefill_without_sequences_returns_empty() -> None:
    key_cache, value_cache = paged_cache(2, SHAPES["d8-gqa3-bs16"])
    query, tables = torch.randn(0, 6, 8), torch.zeros(0, 1, dtype=torch.int32)
    out = triton_ops.paged_prefill_attention(query, key_cache, value_cache, tables, [0], [], 0.3)
    assert out.shape == (0, 6, 8)


def test_the_registry_probes_and_chooses_the_triton_kernels(monkeypatch):
    """Through the registry's own probes (model-shaped inputs vs the reference), as on a GPU."""
    from xinserve.kernels import registry
    from xinserve.kernels.model_shapes import ModelShapes

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    triton_first = ("triton", "reference")
    shapes = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=48,
                         intermediate_size=40, vocab_size=100, block_size=16)
    selection = registry.select(triton_first, torch.device("cpu"), torch.float32, shapes)
    for op in ("write_kv", "prefill_attention", "decode_attention", "rms_norm", "rotary", "silu_and_mul", "top_k_top_p"):
        assert selection.chosen[op] == "triton", selection.rejected
    assert selection.chosen["fused_moe"] == "reference"  # a dense model: never probed
    assert selection.ops.paged_decode_attention is triton_ops.paged_decode_attention
    # a sliding window: the attention kernels decline (the KV write still serves)
    windowed = registry.select(triton_first, torch.device("cpu"), torch.float32, replace(shapes, sliding_window=16))
    assert windowed.chosen["write_kv"] == "triton"
    for op in ("prefill_attention", "decode_attention"):
        assert windowed.chosen[op] == "reference"
        assert dict(windowed.rejected[op])["triton"].startswith("sliding window unsupported")
