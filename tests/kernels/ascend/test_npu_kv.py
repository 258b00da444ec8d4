"""kernels/ascend/kv.py (Ascend kernels for a KV cache stored in another dtype than the model's: int8 "C8",
or half precision under a float32 model) through the fake torch_npu: each op equals the reference over
the same stored cache, the fake refuses what the operator refuses, the registry picks the candidates
for the matching KV dtype and falls back to the reference with the reason when an operator is missing,
and a whole generation with an int8 cache on the npu path equals the CPU one with the same pool bytes.
Nothing here runs on an NPU."""

import importlib
import random
from dataclasses import replace
from types import ModuleType

import numpy as np
import pytest
import torch

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import kv_quant, registry
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, max_error, scrambled_block_tables
from xinserve.kernels.references import dense as reference

BS = 128  # Ascend's paged kernels want 128
CPU = torch.device("cpu")
SHAPES = ModelShapes(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_is_neox=False,
                     hidden_size=128, intermediate_size=96, vocab_size=300, block_size=BS)
KV_OPS = ("write_kv", "prefill_attention", "decode_attention")
# (model dtype, KV cache dtype): C8 under both half-precision models, bfloat16 / float16 under float32
KINDS = [(torch.bfloat16, torch.int8), (torch.float16, torch.int8), (torch.float32, torch.bfloat16),
         (torch.float32, torch.float16)]
KIND_IDS = ["bf16-int8", "fp16-int8", "fp32-bf16", "fp32-fp16"]


@pytest.fixture
def npu_kv(npu, no_forced_kernels) -> ModuleType:
    return importlib.import_module("xinserve.kernels.ascend.kv")


def stored(num_blocks: int, kv_dtype: torch.dtype, heads: int = 2, head_dim: int = 64, seed: int = 0):
    """Key and value caches [N, BS, KVH, D (+ 4)] holding random values as the pool stores them."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, heads, head_dim)
    return tuple(kv_quant.quantize(torch.randn(shape, generator=gen), kv_dtype) for _ in range(2))


def read(cache: torch.Tensor) -> torch.Tensor:
    return kv_quant.dequantize(cache, 64, torch.float32)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    tolerance = max(TOLERANCE[dtype], TOLERANCE.get(kv_dtype, 0.0))  # the probe's for the attention ops
    error = max_error(got, want)
    assert error <= tolerance, f"max abs err {error:.2e} > {tolerance:.0e}"


@pytest.mark.parametrize("dtype, kv_dtype", KINDS, ids=KIND_IDS)
def test_write_stores_what_the_reference_stores(npu_kv, dtype, kv_dtype):
    key_cache, value_cache = stored(4, kv_dtype)
    slots = torch.tensor([0, BS - 1, BS, 2 * BS + 3, 4 * BS - 1])
    key, value = torch.randn(2, len(slots), 2, 64).to(dtype)
    key[1, 0] = 0  # an all-zero head keeps scale 1
    got_k, got_v, want_k, want_v = key_cache.clone(), value_cache.clone(), key_cache.clone(), value_cache.clone()
    npu_kv.write_kv(key, value, got_k, got_v, slots)
    reference.write_kv(key, value, want_k, want_v, slots)
    # the same bytes: npu_dynamic_quant's scale (absmax / 127) and rounding are the pool's
    assert torch.equal(got_k.view(torch.int8), want_k.view(torch.int8))
    assert torch.equal(got_v.view(torch.int8), want_v.view(torch.int8))


@pytest.mark.parametrize("dtype, kv_dtype", KINDS, ids=KIND_IDS)
def test_decode_equals_the_reference_over_the_same_stored_cache(npu_kv, dtype, kv_dtype):
    lens = [1, BS + 1, 2 * BS + 3, 17]  # one token, just past a block, deep into the third block
    key_cache, value_cache = stored(8, kv_dtype)
    tables_np, lens_np = scrambled_block_tables(lens, BS, 8, seed=2), np.array(lens, np.int32)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    query = torch.randn(len(lens), 8, 64).to(dtype)
    gather = build_decode_gather(tables_np, lens_np, BS, CPU)
    got = npu_kv.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125, gather)
    want = reference.paged_decode_attention(query.float(), key_cache, value_cache, tables, seq_lens, 0.125, gather)
    assert got.dtype == dtype
    close(got, want, dtype, kv_dtype)


@pytest.mark.parametrize("dtype, kv_dtype", KINDS, ids=KIND_IDS)
def test_prefill_equals_the_reference_over_the_same_stored_cache(npu_kv, dtype, kv_dtype):
    # a whole prompt, then a chunk after a cached prefix that crosses a block boundary
    q_lens, seq_lens = [7, 40], [7, BS + 20]
    key_cache, value_cache = stored(8, kv_dtype)
    tables = torch.from_numpy(scrambled_block_tables(seq_lens, BS, 8, seed=1))
    query = torch.randn(sum(q_lens), 8, 64).to(dtype)
    starts = [0, 7, 47]
    got = npu_kv.paged_prefill_attention(query, key_cache, value_cache, tables, starts, seq_lens, 0.125)
    want = reference.paged_prefill_attention(query.float(), key_cache, value_cache, tables, starts, seq_lens, 0.125)
    assert got.dtype == dtype
    close(got, want, dtype, kv_dtype)


def test_the_fake_refuses_int8_pages_with_several_query_tokens_or_misplaced_scales(npu):
    fake = npu.torch_npu
    codes = torch.zeros(2, BS, 2 * 64, dtype=torch.int8)
    scales = torch.ones(2, 2, BS)
    args = {"key_antiquant_scale": scales, "value_antiquant_scale": scales, "key_antiquant_mode": 5,
            "value_antiquant_mode": 5, "block_table": torch.zeros(1, 1, dtype=torch.int32),
            "actual_seq_lengths_kv": [3], "input_layout": "BSND", "num_heads": 8, "num_key_value_heads": 2,
            "block_size": BS, "scale": 0.125}
    out, _ = fake.npu_fused_infer_attention_score(torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), codes, codes,
                                                  **args)
    assert out.shape == (1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="page attention does not support antiquant"):
        fake.npu_fused_infer_attention_score(torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16), codes, codes, **args)
    in_row = scales.transpose(1, 2).contiguous()  # [blocks, BS, KVH]: not mode 5's [blocks, KVH, BS]
    with pytest.raises(RuntimeError, match=r"key_antiquant_scale must be contiguous float32 \[2, 2, 128\]"):
        fake.npu_fused_infer_attention_score(torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), codes, codes,
                                             **{**args, "key_antiquant_scale": in_row})


@pytest.mark.parametrize("dtype, kv_dtype", KINDS, ids=KIND_IDS)
def test_the_registry_picks_them_for_the_matching_kv_dtype(npu_kv, dtype, kv_dtype):
    selection = registry.select(NPU_KERNELS, CPU, dtype, replace(SHAPES, kv_cache_dtype=kv_dtype))
    for op in KV_OPS:
        assert selection.chosen[op] == "npu_kv", selection.rejected
        assert [impl for impl, _ in selection.rejected[op]] == ["npu"]  # it reads the model's dtype only
    if kv_dtype == torch.int8:  # FIA reads host lengths: decode graphs are not captured over it
        assert selection.uncapturable == {"decode_attention": "npu_kv"}
    assert selection.ops.write_kv is npu_kv.write_kv
    # In the model's own dtype npu serves and npu_kv is no candidate at all (nothing to report).
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, SHAPES)
    assert {selection.chosen[op] for op in KV_OPS} == {"npu"} and not selection.rejected


def test_fp8_and_unsupported_shapes_keep_the_reference_and_say_why(npu_kv):
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, replace(SHAPES, kv_cache_dtype=torch.float8_e4m3fn))
    for op in KV_OPS:
        assert selection.chosen[op] == "reference"
        assert dict(selection.rejected[op])["npu_kv"].startswith("KV cache dtype torch.float8_e4m3fn unsupported")
    int8 = replace(SHAPES, kv_cache_dtype=torch.int8)
    selection = registry.select(NPU_KERNELS, CPU, torch.float32, int8)
    assert "float32 with an int8 KV cache unsupported" in dict(selection.rejected["write_kv"])["npu_kv"]
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, replace(int8, block_size=16, head_dim=48,
                                                                     rotary_dim=48))
    reasons = {op: dict(selection.rejected[op])["npu_kv"] for op in ("prefill_attention", "decode_attention")}
    assert reasons == {"prefill_attention": "block_size 16 unsupported (a multiple of 128 up to 512)",
                       "decode_attention": "block_size 16 unsupported with an int8 KV cache (a multiple of 32)"}
    assert selection.chosen["write_kv"] == "npu_kv"


def test_a_missing_operator_falls_back_to_the_reference_with_the_reason(npu_kv, monkeypatch):
    monkeypatch.delattr(npu_kv.torch_npu, "npu_dynamic_quant")
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, replace(SHAPES, kv_cache_dtype=torch.int8))
    assert selection.chosen["write_kv"] == "reference"
    assert dict(selection.rejected["write_kv"])["npu_kv"].startswith("raised AttributeError")
    assert "npu_dynamic_quant" in dict(selection.rejected["write_kv"])["npu_kv"]
    assert selection.chosen["decode_attention"] == "npu_kv"


def test_an_int8_generation_on_npu_equals_cpu_with_the_planned_pool_bytes(npu_platform, tiny_models):
    model = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2)  # head dim 32, GQA 2:1
    # Three blocks for two 252-token prompts sharing a 130-token prefix: chunks, prefix hits, decodes
    # across a block edge, and a preemption when the first to pass 256 tokens needs a third block.
    options = {"dtype": "bfloat16", "block_size": BS, "num_kv_blocks": 3, "max_num_batched_tokens": 64,
               "kv_cache_dtype": "int8"}
    on_npu = LLM(model, device="npu:0", **options)
    on_cpu = LLM(model, device="cpu", **options, kernels={"decode_attention": "reference", "prefill_attention": "reference"})  # the oracle
    assert {on_npu.engine.runner.kernels.chosen[op] for op in KV_OPS} == {"npu_kv"}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = random.Random(1)
    prefix = [rng.randrange(3, on_npu.engine.vocab_size) for _ in range(130)]
    batch = [prefix + [rng.randrange(3, on_npu.engine.vocab_size) for _ in range(122)] for _ in range(2)]
    got = [r.token_ids for r in on_npu.generate(batch, params)]
    assert got == [r.token_ids for r in on_cpu.generate(batch, params)]
    stats = on_npu.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total >= BS
    # the pool the npu path allocated costs what the planner counts per token (codes + scale per head)
    runner = on_npu.engine.runner
    per_token = runner.kv_cache.nbytes // (runner.kv_cache.shape[2] * BS)
    assert per_token == runner.model.kv_bytes_per_token(torch.int8) == 2 * 2 * 2 * (32 + 4)
