"""KV cache storage dtypes (kernels/kv_quant.py): the 8-bit row layout round-trips within its rounding
bound, the write is a pure function of each token (chunking cannot change the stored bytes), the C++
decode kernel equals the reference kernel on the same half-precision or 8-bit cache, both stay within a
bounded error of attention over the unquantized cache, and the registry probes with the cache's dtype."""

import numpy as np
import pytest
import torch

from xinserve.engines.platforms.cpu import KERNEL_PREFERENCE as CPU_KERNELS
from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.cpu import cpp
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, probe_tolerance
from xinserve.kernels.references import dense as reference
from xinserve.kernels.references import mla as mla_reference
from xinserve.kernels.registry import select
from xinserve.kernels.triton import unsupported as triton_unsupported

KINDS = ("bfloat16", "float16", "int8", "fp8_e4m3")
# Largest relative error of one stored value: bf16 / fp16 mantissas; int8: half a step of absmax / 127;
# fp8 e4m3: 3 mantissa bits, half an ulp = 1/16 relative (of values above its subnormals).
ROUND_TRIP = {"bfloat16": 2**-8, "float16": 2**-11, "int8": 0.5 / 127, "fp8_e4m3": 1 / 16}
# Max abs error of decode attention over the stored cache against the float32 cache (outputs of order one)
ATTENTION = {"bfloat16": 1e-2, "float16": 2e-3, "int8": 3e-2, "fp8_e4m3": 1.5e-1}


def test_fp8_is_vllms_alias_and_an_8bit_row_holds_codes_then_a_float32_scale():
    assert kv_quant.KV_CACHE_DTYPES["fp8"] == kv_quant.KV_CACHE_DTYPES["fp8_e4m3"] == torch.float8_e4m3fn
    assert kv_quant.storage_dtype("auto", torch.float32) == torch.float32
    assert kv_quant.head_bytes(64, torch.float32) == 256
    assert kv_quant.head_bytes(64, torch.bfloat16) == 128
    assert kv_quant.head_bytes(64, torch.int8) == kv_quant.head_bytes(64, torch.float8_e4m3fn) == 68
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0]])
    row = kv_quant.quantize(x, torch.int8)
    assert row.shape == (1, 8) and row.dtype == torch.int8
    assert row[0, :4].tolist() == [32, -127, 64, 0]  # round(x / (2 / 127))
    assert row[:, 4:].view(torch.float32).item() == pytest.approx(2 / 127)
    zeros = kv_quant.quantize(torch.zeros(1, 4), torch.int8)  # scale 1, never a division by zero
    assert torch.equal(kv_quant.dequantize(zeros, 4, torch.float32), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible by 4"):
        kv_quant.head_width(6, torch.int8)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stored_value_reads_back_within_its_rounding_bound(kind):
    dtype = kv_quant.KV_CACHE_DTYPES[kind]
    x = torch.randn(64, 2, 16, generator=torch.Generator().manual_seed(0))
    back = kv_quant.dequantize(kv_quant.quantize(x, dtype), 16, torch.float32)
    if kv_quant.is_quantized(dtype):  # bounded relative to each head's absmax
        bound = ROUND_TRIP[kind] * x.abs().amax(-1, keepdim=True) * (1 + 1e-6)
    else:
        bound = ROUND_TRIP[kind] * x.abs() + 1e-12
    assert ((back - x).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_token_is_stored_the_same_whether_written_alone_or_in_a_chunk(kind):
    """What preemption (recompute), chunked prefill and prefix reuse rely on: a token's bytes do not depend
    on which other tokens were written with it."""
    dtype = kv_quant.KV_CACHE_DTYPES[kind]
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    slots = torch.randperm(16, generator=gen)[:12]
    caches = [tuple(torch.zeros(4, 4, 2, 12, dtype=dtype) for _ in range(2)) for _ in range(2)]
    reference.write_kv(key, value, *caches[0], slots)
    for i in range(12):
        reference.write_kv(key[i : i + 1], value[i : i + 1], *caches[1], slots[i : i + 1])
    for whole, one_by_one in zip(*caches):
        assert torch.equal(whole.view(torch.int8), one_by_one.view(torch.int8))


def _decode_inputs(kind: str | None, head_dim: int = 16, block_size: int = 4, num_kv_heads: int = 2):
    """A scrambled pool holding three contexts (1, 5 and 13 tokens), written through the reference write."""
    gen = torch.Generator().manual_seed(2)
    lens = np.array([1, 5, 13], np.int32)
    num_blocks = 16
    tables = np.random.default_rng(0).permutation(num_blocks)[:12].reshape(3, 4).astype(np.int32)
    key = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    dtype = kv_quant.storage_dtype(kind, torch.float32)
    width = kv_quant.head_width(head_dim, dtype)
    caches = tuple(torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=dtype) for _ in range(2))
    reference.write_kv(key, value, *caches, torch.arange(num_blocks * block_size))
    query = torch.randn(3, 2 * num_kv_heads, head_dim, generator=gen)
    gather = build_decode_gather(tables, lens, block_size, torch.device("cpu"))
    return query, caches, torch.from_numpy(tables), torch.from_numpy(lens), gather


@pytest.mark.parametrize("kind", KINDS)
def test_cpp_decode_equals_the_reference_on_the_same_stored_cache_and_both_stay_near_float32(kind):
    query, caches, tables, lens, gather = _decode_inputs(kind)
    want = reference.paged_decode_attention(query, *caches, tables, lens, 0.25, gather)
    got = cpp.paged_decode_attention(query, *caches, tables, lens, 0.25)
    assert (got - want).abs().max() < 1e-5  # same codes, float32 accumulation on both sides
    _, exact_caches, *_ = _decode_inputs(None)
    exact = reference.paged_decode_attention(query, *exact_caches, tables, lens, 0.25, gather)
    assert (want - exact).abs().max() < ATTENTION[kind]


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
def test_reference_prefill_reads_the_stored_cache_like_decode(kind):
    """The last query of a prefill over the stored cache is the decode of that token over the same cache."""
    query, caches, tables, lens, gather = _decode_inputs(kind)
    seq_len = int(lens[2])
    prefill = reference.paged_prefill_attention(query[2:3], *caches, tables[2:3], [0, 1], [seq_len], 0.25)
    decode = reference.paged_decode_attention(query, *caches, tables, lens, 0.25, gather)[2:3]
    assert (prefill - decode).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_mla_reads_a_half_precision_latent_cache_as_its_widened_values(kind):
    """MLA's latent cache takes the half-precision kinds (8-bit is refused at start): decode and prefill over
    it equal the float32 attention over the same, widened latents."""
    _, (latent, _), tables, lens, gather = _decode_inputs(kind, head_dim=24, num_kv_heads=1)
    latent = latent.view(*latent.shape[:2], -1)  # [N, BS, C], C = R 16 + dr 8
    widened = latent.float()
    query = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(3))
    got = mla_reference.mla_decode_attention(query, latent, 16, tables, lens, 0.2, gather)
    assert torch.allclose(got, mla_reference.mla_decode_attention(query, widened, 16, tables, lens, 0.2, gather))
    up = torch.randn(4, 8 + 8, 16, generator=torch.Generator().manual_seed(4))  # [H, dn + dv, R]
    prefill_query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))  # [T, H, dn + dr]
    args = (tables[2:3], [0, 2], [int(lens[2])], 0.2)
    got = mla_reference.mla_prefill_attention(prefill_query, latent, up, *args)
    assert torch.allclose(got, mla_reference.mla_prefill_attention(prefill_query, widened, up, *args))


def _shapes(kv_cache_dtype: torch.dtype) -> ModelShapes:
    return ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True, hidden_size=64,
                       intermediate_size=128, vocab_size=64, block_size=4, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_the_registry_probes_with_the_kv_dtype_and_chooses_a_kernel_that_reads_it(dtype):
    selection = select(CPU_KERNELS, torch.device("cpu"), torch.float32, _shapes(dtype), None)
    assert selection.chosen["decode_attention"] in ("cpp", "reference")  # the faster one, measured
    assert "cpp" not in [name for name, _ in selection.rejected.get("decode_attention", [])]
    assert triton_unsupported("decode_attention", _shapes(dtype), torch.float32).startswith("KV cache dtype")
    assert triton_unsupported("decode_attention", _shapes(None), torch.float32) is None


def _read_back_by_cpp(value_rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The C++ kernel's reading of each stored row [N, W]: a one-token context per sequence, whose attention
    output is that token's value exactly (its softmax weight is exp(0) = 1)."""
    num_rows = value_rows.shape[0]
    caches = (torch.zeros_like(value_rows).view(num_rows, 1, 1, -1), value_rows.reshape(num_rows, 1, 1, -1))
    tables = torch.arange(num_rows, dtype=torch.int32)[:, None]
    query = torch.zeros(num_rows, 1, head_dim)
    return cpp.paged_decode_attention(query, *caches, tables, torch.ones(num_rows, dtype=torch.int32), 1.0)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpp_widens_every_finite_half_precision_value_exactly(dtype):
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = bits[torch.isfinite(bits.float())]
    values = values[: len(values) // 64 * 64].view(-1, 64)
    assert torch.equal(_read_back_by_cpp(values, 64), values.float())


def test_cpp_reads_every_fp8_code_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = torch.where(torch.isnan(codes.float()), torch.zeros_like(codes.float()), codes.float()).to(codes.dtype)
    scale = torch.full((4, 1), 0.5).view(torch.int8)  # every row scaled by 0.5
    rows = torch.cat((codes.view(torch.int8).view(4, 64), scale.view(4, 4)), dim=-1).view(torch.float8_e4m3fn)
    assert torch.equal(_read_back_by_cpp(rows, 64), codes.float().view(4, 64) * 0.5)


def test_a_candidate_is_held_to_the_kv_dtypes_tolerance_where_it_is_looser():
    # a float32 model's attention over a bfloat16 cache may read bfloat16 queries; an 8-bit write may
    # round a token to the neighbouring code; everything else keeps the model dtype's tolerance
    assert probe_tolerance("decode_attention", _shapes(torch.bfloat16), torch.float32) == TOLERANCE[torch.bfloat16]
    assert probe_tolerance("decode_attention", _shapes(torch.int8), torch.bfloat16) == TOLERANCE[torch.bfloat16]
    assert probe_tolerance("decode_attention", _shapes(torch.float8_e4m3fn), torch.float32) == TOLERANCE[torch.float32]
    assert probe_tolerance("write_kv", _shapes(torch.float8_e4m3fn), torch.float32) == 0.25
    assert probe_tolerance("write_kv", _shapes(torch.int8), torch.float16) == 3e-2
    assert probe_tolerance("rms_norm", _shapes(torch.bfloat16), torch.float32) == TOLERANCE[torch.float32]
