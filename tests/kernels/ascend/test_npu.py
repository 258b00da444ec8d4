"""The Ascend kernels (kernels/ascend/ops.py) through the fake torch_npu (tests/fakes/torch_npu): each op
equals the reference, the fake refuses what the real operators refuse, the registry picks them on
an "npu" platform, and a whole greedy generation on that path equals the CPU one token for token.

Nothing here runs on an NPU: the fake checks the operators' argument conventions and computes their
documented formulas with the reference math, on CPU tensors.
"""

import random
from types import ModuleType

import numpy as np
import pytest
import torch

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, applies, max_error
from xinserve.kernels.references import dense as reference

BS = 128  # Ascend's paged kernels want 128


@pytest.fixture
def fake(npu) -> ModuleType:
    return npu.torch_npu


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = max_error(got, want)
    assert error <= TOLERANCE[dtype], f"max abs err {error:.2e} > {TOLERANCE[dtype]:.0e}"


def paged(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Random key and value caches [N, BS, KVH, D]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def tables(seq_lens: list[int], num_blocks: int, seed: int = 0) -> np.ndarray:
    """[S, B] int32 block tables over a shuffled pool, zero-padded."""
    needed = [-(-n // BS) for n in seq_lens]
    order = np.random.default_rng(seed).permutation(num_blocks)
    table, start = np.zeros((len(seq_lens), max(needed)), np.int32), 0
    for i, n in enumerate(needed):
        table[i, :n] = order[start : start + n]
        start += n
    return table


def f32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


# (query heads, kv heads, head dim, dtype): GQA 4:1, MHA in float16, GQA 2:1 at the common head dim 128
HEADS = [(8, 2, 32, torch.bfloat16), (4, 4, 64, torch.float16), (4, 2, 128, torch.bfloat16)]
HEAD_IDS = ["gqa4-d32-bf16", "mha-d64-fp16", "gqa2-d128-bf16"]
HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", HEADS, ids=HEAD_IDS)
def test_write_kv_equals_the_reference(npu, heads, kv_heads, head_dim, dtype):
    key_cache, value_cache = paged(4, kv_heads, head_dim, dtype)
    slots = torch.tensor([0, BS - 1, BS, 2 * BS + 3, 4 * BS - 1])
    # value as the model has it: a strided view of the fused qkv projection
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim).to(dtype)
    _, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    key, value = key.view(-1, kv_heads, head_dim), value.view(-1, kv_heads, head_dim)
    assert not value.is_contiguous()
    got_k, got_v = key_cache.clone(), value_cache.clone()
    want_k, want_v = key_cache.clone(), value_cache.clone()
    npu.write_kv(key, value, got_k, got_v, slots)
    reference.write_kv(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_write_kv_skips_an_empty_step(npu):
    key_cache, value_cache = paged(2, 2, 32, torch.bfloat16)
    before = key_cache.clone()
    empty = torch.empty(0, 2, 32, dtype=torch.bfloat16)
    npu.write_kv(empty, empty, key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(key_cache, before)


# (new tokens, context length) per prefill sequence
PREFILLS = {
    "whole-prompts": ([7, 130, 3], [7, 130, 3]),
    "chunk-after-cached-prefix-mid-block": ([5], [BS + 8]),
    "chunk-crossing-a-block-boundary": ([40, 9], [BS + 20, 2 * BS + 1]),
}


@pytest.mark.parametrize("case", PREFILLS, ids=list(PREFILLS))
@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", HEADS, ids=HEAD_IDS)
def test_prefill_attention_equals_the_reference(npu, case, heads, kv_heads, head_dim, dtype):
    q_lens, seq_lens = PREFILLS[case]
    num_blocks = 8
    key_cache, value_cache = paged(num_blocks, kv_heads, head_dim, dtype)
    block_tables = torch.from_numpy(tables(seq_lens, num_blocks))
    query = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    starts = np.concatenate(([0], np.cumsum(q_lens))).tolist()
    scale = head_dim**-0.5
    got = npu.paged_prefill_attention(query, key_cache, value_cache, block_tables, starts, seq_lens, scale)
    want = reference.paged_prefill_attention(*f32(query, key_cache, value_cache), block_tables, starts,
                                             seq_lens, scale)
    assert got.dtype == dtype
    close(got, want, dtype)


@pytest.mark.parametrize("heads, kv_heads, head_dim, dtype", HEADS, ids=HEAD_IDS)
def test_decode_attention_equals_the_reference(npu, heads, kv_heads, head_dim, dtype):
    lens = [1, BS + 1, 2 * BS + 3, 17]  # one token, just past a block, deep into the third block
    num_blocks = 8
    key_cache, value_cache = paged(num_blocks, kv_heads, head_dim, dtype)
    tables_np, lens_np = tables(lens, num_blocks), np.array(lens, np.int32)
    block_tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    query = torch.randn(len(lens), heads, head_dim).to(dtype)
    gather = build_decode_gather(tables_np, lens_np, BS, torch.device("cpu"))
    scale = head_dim**-0.5
    got = npu.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, gather)
    want = reference.paged_decode_attention(*f32(query, key_cache, value_cache), block_tables, seq_lens,
                                            scale, gather)
    close(got, want, dtype)


@pytest.mark.parametrize("shape", [(5, 96), (5, 4, 32)], ids=["hidden", "per-head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_with_and_without_residual_equals_the_reference(npu, shape, dtype):
    x, residual = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    close(npu.rms_norm(x, weight, 1e-6), reference.rms_norm(*f32(x, weight), 1e-6), dtype)
    got = npu.rms_norm(x, weight, 1e-6, residual)
    want = reference.rms_norm(*f32(x, weight), 1e-6, residual.float())
    close(got, want, dtype)


# (head dim, rotary dim, neox): Llama / Qwen (full, neox), partial neox, GLM-4 (partial, interleaved)
ROTARY = [(64, 64, True), (64, 32, True), (64, 32, False), (128, 128, False)]


@pytest.mark.parametrize("head_dim, rotary_dim, is_neox", ROTARY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_equals_the_reference(npu, head_dim, rotary_dim, is_neox, dtype):
    positions = torch.tensor([0, 1, 17, 130, 511, 3])
    half = rotary_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [512, rotary_dim]
    query = torch.randn(len(positions), 8, head_dim).to(dtype)
    key = torch.randn(len(positions), 2, head_dim).to(dtype)
    got = npu.rotary_embedding(query, key, npu.rotary_cos_sin(positions, cache, is_neox, dtype), is_neox)
    table = reference.rotary_cos_sin(positions, cache, is_neox, torch.float32)
    want = reference.rotary_embedding(*f32(query, key), table, is_neox)
    close(got, want, dtype)
    # the tail past rotary_dim passes through untouched
    assert torch.equal(got[0][..., rotary_dim:], query[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_equals_the_reference(npu, dtype):
    x = torch.randn(5, 2 * 48).to(dtype)
    close(npu.silu_and_mul(x), reference.silu_and_mul(x.float()), dtype)


def test_top_k_top_p_equals_the_reference(npu):
    logits = 3 * torch.randn(5, 300)
    top_k = torch.tensor([[0], [5], [1], [50], [0]])
    top_p = torch.tensor([[1.0], [0.9], [0.5], [0.8], [0.6]])
    got = npu.top_k_top_p(logits, top_k, top_p)
    want = reference.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert max_error(got, want) == 0.0


# ---- the fake refuses what the real operators refuse ----

def test_the_fake_refuses_an_int64_slot_mapping(fake):
    key_cache, value_cache = paged(2, 2, 32, torch.bfloat16)
    key = torch.randn(3, 2, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="ReshapeAndCache.*slot_indices dtype torch.int64"):
        fake._npu_reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0, 1, 2]))


def fia_args(block_size: int = BS, num_blocks: int = 4):
    """A valid prefill call: two sequences of 3 and 4 new tokens over contexts of 3 and 130."""
    key_cache, value_cache = torch.zeros(2, num_blocks, block_size, 2, 32, dtype=torch.bfloat16)
    query = torch.randn(7, 4, 32).to(torch.bfloat16)
    kwargs = {
        "atten_mask": torch.ones(2048, 2048, dtype=torch.int8).triu_(1),
        "block_table": torch.tensor([[0, 0], [1, 2]], dtype=torch.int32),
        "input_layout": "TND", "block_size": block_size, "sparse_mode": 3, "scale": 32**-0.5,
        "actual_seq_lengths": [3, 7], "actual_seq_lengths_kv": [3, 130],
        "num_heads": 4, "num_key_value_heads": 2,
    }
    key, value = key_cache.view(num_blocks, block_size, -1), value_cache.view(num_blocks, block_size, -1)
    return query, key, value, kwargs


def test_the_fake_accepts_the_valid_call(fake):
    query, key, value, kwargs = fia_args()
    out, _ = fake.npu_fused_infer_attention_score(query, key, value, **kwargs)
    assert out.shape == query.shape


@pytest.mark.parametrize("change, error, match", [
    # our [N, BS, KVH, D] cache passed as is: read as [N, KVH, BS, D], it does not fit
    ("cache-layout", RuntimeError, "neither"),
    ("per-sequence-query-lengths", RuntimeError, "non-decreasing cumulative|ends at"),
    ("tensor-lengths", TypeError, "must be tuple of ints"),
    ("kv-lengths-past-the-table", RuntimeError, "actual_seq_lengths_kv"),
    ("int64-block-table", RuntimeError, "block_table dtype torch.int64"),
    ("float32", RuntimeError, "query dtype torch.float32"),
    ("full-mask", RuntimeError, "2048"),
])
def test_the_fake_refuses_wrong_fused_attention_arguments(fake, change, error, match):
    query, key, value, kwargs = fia_args()
    if change == "cache-layout":
        key, value = key.view(4, BS, 2, 32), value.view(4, BS, 2, 32)
    elif change == "per-sequence-query-lengths":
        kwargs["actual_seq_lengths"] = [3, 4]
    elif change == "tensor-lengths":
        kwargs["actual_seq_lengths_kv"] = torch.tensor([3, 130], dtype=torch.int32)
    elif change == "kv-lengths-past-the-table":
        kwargs["actual_seq_lengths_kv"] = [3, 2 * BS + 1]  # past what the block table reaches
    elif change == "int64-block-table":
        kwargs["block_table"] = kwargs["block_table"].long()
    elif change == "float32":
        query, key, value = query.float(), key.float(), value.float()
    elif change == "full-mask":
        kwargs["atten_mask"] = torch.ones(7, 130, dtype=torch.bool).triu_(1)
    with pytest.raises(error, match=match):
        fake.npu_fused_infer_attention_score(query, key, value, **kwargs)


def test_the_fake_refuses_block_sizes_the_kernels_reject(fake):
    query, key, value, kwargs = fia_args(block_size=64, num_blocks=8)
    with pytest.raises(RuntimeError, match="block_size 64 must be a multiple of 128"):
        fake.npu_fused_infer_attention_score(query, key, value, **kwargs)
    # paged decode: head_dim * block_size over 128 * 128
    key_cache = torch.zeros(2, BS, 1, 256, dtype=torch.bfloat16)
    query = torch.zeros(1, 2, 256, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="PagedAttention.*head_size 256 with block_size 128"):
        fake._npu_paged_attention(query, key_cache, key_cache, 1, 2, 1.0, table, lens, query.clone())


def test_the_fake_refuses_other_wrong_dtypes(fake):
    query = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="RopeWithSinCosCache.*share a float dtype"):
        fake.npu_mrope(torch.tensor([0, 1]), query, query, torch.zeros(8, 32), 32)
    with pytest.raises(RuntimeError, match="ApplyTopKTopP.*int32"):
        fake.npu_top_k_top_p(torch.zeros(2, 8), p=torch.ones(2), k=torch.tensor([1, 2]))
    q, cache = torch.zeros(1, 2, 32, dtype=torch.bfloat16), torch.zeros(2, BS, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="PagedAttention.*context_lens dtype torch.int64"):
        fake._npu_paged_attention(q, cache, cache, 1, 2, 1.0, torch.zeros(1, 1, dtype=torch.int32),
                                  torch.tensor([5]), torch.empty_like(q))


# ---- the registry on an "npu" platform ----

# GLM-4-like: GQA 4:1, partial interleaved rotary
SHAPES = ModelShapes(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_is_neox=False,
                     hidden_size=128, intermediate_size=96, vocab_size=300, block_size=BS)
CPU = torch.device("cpu")
# every op a dense model calls on npu; fused_moe, which it never calls, stays the unprobed reference, and so
# does the dense linear: F.linear is already the device's matmul (the C++ decode linear is a CPU candidate)
ALL_NPU = {op: "npu" if applies(op, SHAPES) and op != "linear" else "reference" for op in registry.OPS}


@pytest.mark.parametrize("dtype", HALF)
def test_the_registry_chooses_npu_for_every_op(npu, no_forced_kernels, dtype):
    selection = registry.select(NPU_KERNELS, CPU, dtype, SHAPES)
    assert selection.chosen == ALL_NPU, selection.rejected
    assert selection.ops.paged_prefill_attention is npu.paged_prefill_attention
    # the paged decode records its host-length calls while a graph is captured (engines/worker/graphs.py)
    assert selection.capture_hooks == [npu.recording_graph_tasks] and selection.uncapturable == {}


def test_the_registry_skips_what_the_operators_decline(npu, no_forced_kernels):
    selection = registry.select(NPU_KERNELS, CPU, torch.float32, SHAPES)
    for op in ("write_kv", "prefill_attention", "decode_attention"):
        assert selection.chosen[op] == "reference"
        assert selection.rejected[op] == [("npu", "float32 unsupported (float16 / bfloat16 only)")]
    assert {selection.chosen[op] for op in ("rms_norm", "rotary", "silu_and_mul", "top_k_top_p")} == {"npu"}
    narrow = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True,
                         hidden_size=64, intermediate_size=96, vocab_size=300, block_size=16)
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, narrow)
    reasons = {op: dict(selection.rejected.get(op, [])).get("npu") for op in registry.OPS}
    assert reasons["rotary"] == "head_dim 16 / rotary_dim 16 unsupported (multiples of 32)"
    assert reasons["prefill_attention"] == "block_size 16 unsupported (a multiple of 128 up to 512)"
    assert selection.chosen["decode_attention"] == "npu"  # the paged decode kernel takes blocks of 16


def test_a_failing_operator_falls_back_to_the_reference_with_its_error(fake, no_forced_kernels, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("aclnnFusedInferAttentionScore error 161002")

    monkeypatch.setattr(fake, "npu_fused_infer_attention_score", broken)
    selection = registry.select(NPU_KERNELS, CPU, torch.bfloat16, SHAPES)
    assert selection.chosen["prefill_attention"] == "reference"
    assert selection.rejected["prefill_attention"] == [
        ("npu", "raised RuntimeError: aclnnFusedInferAttentionScore error 161002")]
    assert selection.chosen["decode_attention"] == "npu"


# ---- a whole generation on the npu path ----

def prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Three prompts of 241-248 tokens sharing a 130-token prefix (one whole block of 128)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(130)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(111, 118))] for _ in range(3)]


@pytest.mark.parametrize("arch, config", [
    ("llama", {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}),  # head dim 32, GQA 2:1, neox
    ("glm4", {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1}),  # head dim 64, rotary 32, interleaved
])
def test_greedy_generation_on_npu_equals_cpu(npu_platform, tiny_models, arch, config):
    model = tiny_models(arch, **config)
    # A 64-token budget chunks every prompt and mixes chunks with decodes. The first prompt runs
    # alone and leaves its prefix block cached; the other two reuse it and fill the three blocks,
    # until the first to decode past 256 tokens needs a third block and preempts the other.
    options = {"dtype": "bfloat16", "block_size": BS, "num_kv_blocks": 3, "max_num_batched_tokens": 64}
    on_npu = LLM(model, device="npu:0", **options)
    on_cpu = LLM(model, device="cpu", **options,  # the oracle: every op the reference (a C++ KV write is a candidate)
                 kernels={"decode_attention": "reference", "prefill_attention": "reference", "write_kv": "reference",
                          "linear": "reference"})
    assert on_npu.engine.runner.kernels.chosen == ALL_NPU
    assert set(on_cpu.engine.runner.kernels.chosen.values()) == {"reference"}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = prompts(on_npu.engine.vocab_size, seed=1)
    for part in (batch[:1], batch[1:]):
        got = [r.token_ids for r in on_npu.generate(part, params)]
        want = [r.token_ids for r in on_cpu.generate(part, params)]
        assert got == want
    stats = on_npu.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total >= 2 * BS
    assert stats == on_cpu.engine.stats()  # the same schedule on both paths
    assert stats == on_cpu.engine.stats()
